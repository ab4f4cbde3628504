"""The images and videos task rows refer to: open, decode, size and load them (user guide: ``docs/data.md``).

- ``open_image(ref, base_dir)``: one image reference (a path, relative to ``base_dir`` or absolute, a
  ``file://`` path, an http(s) URL, a ``data:image/...;base64,`` URI, raw bytes, a ``{"bytes", "path"}`` dict
  as ``datasets`` stores images, or a PIL image) as a decoded RGB PIL image; DataError naming the problem.
- ``load_video(ref, base_dir)``: a video file's frames through ``qwen_vl_utils.fetch_video`` (needs a
  video reader: torchcodec or decord). A video given as a list of frame images needs no reader: each frame
  is an image. ``is_video_ref`` tells a video file (by its suffix) from an image.
- ``model_image_size(size, factor, min_pixels, max_pixels)``: the size a Qwen-VL processor resizes an image to.
"""

import base64
import binascii
import functools
import io
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from mmgrpo.errors import DataError

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpeg", ".mpg", ".flv", ".wmv")
"""An image field's reference whose path ends in one of these is a video file (its frames become images)."""
URL_SCHEMES = ("http", "https")
URL_TIMEOUT_S = 30.0


def describe_ref(ref: Any) -> str:
    """A short, printable description of an image reference (long strings and bytes are not printed whole)."""
    if isinstance(ref, Image.Image):
        return f"<PIL image {ref.width}x{ref.height}>"
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            path = f" from '{ref['path']}'" if ref.get("path") else ""
            return f"<{len(ref['bytes'])} bytes{path}>"
        return repr(ref.get("path"))
    if isinstance(ref, str):
        if ref.startswith("data:"):
            return f"'{ref[:30]}...' ({len(ref)} chars)"
        return repr(ref if len(ref) <= 120 else ref[:100] + "...")
    return f"<{type(ref).__name__}>"


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB; transparent pixels become white, as ``qwen_vl_utils.to_rgb`` does."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def _ref_kind(ref: Any) -> str:
    """'pil' | 'bytes' | 'data' | 'url' | 'path', or raise DataError for a value that is no image reference."""
    if isinstance(ref, Image.Image):
        return "pil"
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            if not isinstance(ref["bytes"], (bytes, bytearray, memoryview)):
                raise DataError(f"image dict's 'bytes' is {type(ref['bytes']).__name__}, expected bytes")
            return "bytes"
        if isinstance(ref.get("path"), str) and ref["path"]:
            return _ref_kind(ref["path"])
        raise DataError(
            f"image dict {sorted(ref)} has neither 'bytes' nor 'path'; an image dict is "
            "{'bytes': <file bytes>, 'path': <name>} as datasets stores images"
        )
    if isinstance(ref, str):
        if not ref.strip():
            raise DataError("the image reference is an empty string")
        if ref.startswith("data:"):
            return "data"
        scheme = urlparse(ref).scheme.lower()
        if scheme in URL_SCHEMES:
            return "url"
        return "path"
    raise DataError(
        f"an image reference must be a path, an http(s) URL, a data:image/...;base64, URI, bytes, a "
        f"{{'bytes', 'path'}} dict or a PIL image; got {type(ref).__name__}"
    )


def _ref_value(ref: Any) -> Any:
    """The string or bytes inside a ``{"bytes", "path"}`` dict (the reference itself otherwise)."""
    if isinstance(ref, dict):
        return ref["bytes"] if ref.get("bytes") is not None else ref["path"]
    return ref


def _resolve(path: str, base_dir: Path | str | None) -> Path:
    if path.startswith("file://"):
        path = path[len("file://") :]
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return p


def _existing_file(path: str, base_dir: Path | str | None) -> Path:
    p = _resolve(path, base_dir)
    if not p.exists():
        raise DataError(f"image file '{path}' not found (looked for {p.absolute()})")
    if not p.is_file():
        raise DataError(f"image path '{path}' is not a file ({p.absolute()})")
    return p


def _data_uri_bytes(uri: str) -> bytes:
    head, comma, payload = uri.partition(",")
    if not comma or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise DataError(f"data URI {describe_ref(uri)} is not of the form 'data:image/<type>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"data URI {describe_ref(uri)} is not valid base64 ({e})") from None


def _check_url(url: str) -> None:
    parsed = urlparse(url)
    if not parsed.netloc or " " in url:
        raise DataError(f"image URL {describe_ref(url)} is malformed (expected http(s)://host/...)")


@functools.lru_cache(maxsize=64)
def _fetch_url(url: str) -> bytes:
    import httpx

    try:
        response = httpx.get(url, timeout=URL_TIMEOUT_S, follow_redirects=True)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise DataError(
            f"image URL {describe_ref(url)} could not be fetched ({type(e).__name__}: {e})"
        ) from None
    return response.content


def _open(ref: Any, base_dir: Path | str | None) -> Image.Image:
    """The PIL image of ``ref``, opened (not yet decoded); DataError naming the problem."""
    kind = _ref_kind(ref)
    value = _ref_value(ref)
    if kind == "pil":
        return value
    if kind == "path":
        target: Any = _existing_file(value, base_dir)
    elif kind == "data":
        target = io.BytesIO(_data_uri_bytes(value))
    elif kind == "url":
        _check_url(value)
        target = io.BytesIO(_fetch_url(value))
    else:
        target = io.BytesIO(bytes(value))
    try:
        return Image.open(target)
    except Image.DecompressionBombError as e:
        raise DataError(f"image {describe_ref(ref)} is too large to open safely ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"image {describe_ref(ref)} cannot be decoded: {_short(e)}") from None


def _decode(image: Image.Image, ref: Any) -> Image.Image:
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise DataError(f"image {describe_ref(ref)} is too large to decode safely ({e})") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(
            f"image {describe_ref(ref)} cannot be decoded (corrupt or truncated): {_short(e)}"
        ) from None
    return image


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def open_image(ref: Any, base_dir: Path | str | None = None) -> Image.Image:
    """The image ``ref`` refers to, decoded and in RGB (transparency on white), at its original size.

    ``ref``: a path (relative to ``base_dir``, None = the working directory, or absolute; ``file://``
    allowed), an http(s) URL (fetched; the bytes are cached per process), a ``data:image/...;base64,`` URI,
    raw bytes, a ``{"bytes": ..., "path": ...}`` dict (``bytes`` wins when set) or a PIL image.
    Raises DataError saying what is wrong (file not found, not an image, truncated, bad base64, ...).
    """
    image = _decode(_open(ref, base_dir), ref)
    rgb = to_rgb(image)
    if isinstance(ref, Image.Image):
        return rgb
    if rgb is image:
        if getattr(image, "fp", None) is None:
            return image  # decoded, and load() already closed the file
        rgb = image.copy()  # a multi-frame file stays open after load(): detach the pixels from it
    image.close()
    return rgb


def ref_image_size(ref: Any, base_dir: Path | str | None, decode: bool) -> tuple[int, int] | None:
    """Check one image reference at check time; its (width, height), or None for a URL (not fetched)."""
    kind = _ref_kind(ref)
    if kind == "url":
        _check_url(_ref_value(ref))
        return None
    image = _open(ref, base_dir)
    try:
        if decode:
            _decode(image, ref)
        return image.size
    finally:
        if kind != "pil":
            image.close()


def model_image_size(
    size: tuple[int, int], factor: int = 28, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int]:
    """The (width, height) a Qwen-VL image processor resizes an image of ``size`` (width, height) to.

    The rule of transformers' Qwen2-VL image processor (``smart_resize`` in
    ``transformers.models.qwen2_vl.image_processing_qwen2_vl``), restated here so that checking a dataset
    imports neither torch nor transformers: both sides become multiples of ``factor`` (28 for Qwen2-VL and
    Qwen2.5-VL: 14-px patches merged 2x2; 32 for Qwen3-VL) with the area kept within
    ``[min_pixels, max_pixels]`` and the aspect ratio as close as possible. None means ``4 * factor**2`` and
    ``16384 * factor**2`` (3136 and 12845056 for factor 28: the values in Qwen2.5-VL's published processor
    configs and qwen_vl_utils' defaults). ``qwen_vl_utils.smart_resize`` (0.0.14) differs from the processor
    for very thin images (e.g. 1000x10 gives 1008x28 there and 560x28 in the processor), hence this copy.
    Raises ValueError for an aspect ratio over 200, as the processor does.
    """
    width, height = size
    min_pixels = 4 * factor**2 if min_pixels is None else min_pixels
    max_pixels = 16384 * factor**2 if max_pixels is None else max_pixels
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


# --------------------------------------------------------------------------------------------- video
def video_reader() -> str | None:
    """The video reader ``qwen_vl_utils.fetch_video`` would use for a video file, or None when none works:
    torchcodec or decord when installed, else torchvision's ``io.read_video`` where that still exists."""
    import importlib.util

    forced = os.environ.get("FORCE_QWENVL_VIDEO_READER")
    if forced:
        return forced
    for name in ("torchcodec", "decord"):
        if importlib.util.find_spec(name) is not None:
            return name
    try:
        import torchvision.io
    except ImportError:
        return None
    return "torchvision" if hasattr(torchvision.io, "read_video") else None


NO_VIDEO_READER = (
    "reading a video file needs a video reader for qwen_vl_utils: pip install torchcodec (or decord); "
    "or give the video as a list of frame images"
)


def is_video_ref(ref: Any) -> bool:
    """True for a reference to a video file: a path (or ``{"path": ...}`` dict without bytes) ending in one of
    ``VIDEO_SUFFIXES``."""
    if isinstance(ref, dict) and ref.get("bytes") is None:
        ref = ref.get("path")
    return (
        isinstance(ref, str)
        and Path(urlparse(ref).path if "://" in ref else ref).suffix.lower() in VIDEO_SUFFIXES
    )


def video_path(ref: Any, base_dir: Path | str | None) -> Path:
    path = ref.get("path") if isinstance(ref, dict) else ref
    if not isinstance(path, str) or not path.strip():
        raise DataError(f"a video must be a file path or a list of frame images, got {describe_ref(ref)}")
    if urlparse(path).scheme.lower() in URL_SCHEMES:
        raise DataError(f"video {describe_ref(path)}: video URLs are not supported; download the file")
    p = _resolve(path, base_dir)
    if not p.is_file():
        raise DataError(f"video file '{path}' not found (looked for {p.absolute()})")
    return p


def load_video(
    ref: Any,
    base_dir: Path | str | None = None,
    *,
    fps: float = 2.0,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    image_factor: int = 28,
) -> list[Image.Image]:
    """The frames of a video file (``ref``: a path, or a ``{"path": ...}`` dict) as RGB PIL images, sampled at
    ``fps`` and resized by ``qwen_vl_utils.fetch_video`` (its frame budget, within ``min/max_pixels``)."""
    p = video_path(ref, base_dir)
    if video_reader() is None:
        raise DataError(f"video {describe_ref(ref)}: {NO_VIDEO_READER}")
    from qwen_vl_utils import fetch_video

    element: dict[str, Any] = {"video": str(p), "fps": fps}
    if min_pixels is not None:
        element["min_pixels"] = min_pixels
    if max_pixels is not None:
        element["max_pixels"] = max_pixels
    try:
        video = fetch_video(element, image_patch_size=image_factor // 2)  # (T, C, H, W) float
    except Exception as e:  # the readers raise many kinds (RuntimeError, ValueError, ...)
        raise DataError(
            f"video {describe_ref(ref)} cannot be read: {type(e).__name__}: {_short(e)}"
        ) from None
    frames = video.clamp(0, 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()  # (T, H, W, C)
    return [Image.fromarray(frame) for frame in frames]


# --------------------------------------------------------------------------------------------- checking
