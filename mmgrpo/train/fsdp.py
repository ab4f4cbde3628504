"""FSDP2 for the trainer: parameters, gradients and AdamW state sharded over the processes.

PyTorch's ``fully_shard`` is applied per decoder layer (each layer one unit: its parameters are gathered
for its forward and backward and sharded again after) and once on the whole model (the root unit: the
embeddings, the final norm, the LM head and, in a VLM, the vision tower and projector). Each process then
holds 1/W of every parameter as a ``DTensor`` shard, and its gradient and AdamW moments are shards too;
gradients are reduce-scattered (averaged) in every backward.

Every forward of a sharded model is a collective: all processes must run the same units in the same
order. The trainer keeps that in two ways:

- **training passes in lockstep**: every process runs the same number of micro-batches (a process with
  fewer adds zero-weight ones, as under DDP), each one forward through the whole model (the full path, not
  the shared prefill, whose number of forwards depends on the batch);
- **sampling and evaluation on gathered weights** (:func:`gathered`, ``model.fsdp_rollout: gathered``):
  before a rollout every unit is gathered once and kept whole until the rollout ends, so decoding runs no
  collective at all and each process decodes its own episodes at its own pace (any number of tokens and
  turns, images or not). The price is the whole model's parameters (not gradients or optimizer state) on
  every process during the rollout: 2 bytes per parameter in bf16, 17 GB for a 7B VLM
  (docs/distributed.md has the arithmetic);
- **or in lockstep on the shards** (:class:`Lockstep`, ``model.fsdp_rollout: lockstep``): every process
  runs as many forwards, one layer gathered at a time.

The KL reference is a copy of the model made before sharding and sharded the same way
(:func:`shard_copy`), so no process ever holds a whole copy after start-up. Checkpoints hold each process's
shards (``torch.distributed.checkpoint``, :func:`save_sharded`, :func:`load_sharded`); the final model is
gathered into one state dict (:func:`full_state_dict`) and saved as a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from mmgrpo.model.adapters import SHARDS_FLAG
from mmgrpo.train.distributed import global_sum

SHARDS_DIR = "fsdp_shards"
"""The folder of a checkpoint that holds every process's shards (model, optimizer, reference)."""


def available() -> bool:
    """Whether this torch has FSDP2 (``torch.distributed.fsdp.fully_shard``)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return torch.distributed.is_available()


def units(model: nn.Module, is_vision: Callable[[str], bool]) -> list[nn.Module]:
    """The modules sharded as their own units: the model's decoder layers (its ``_no_split_modules``
    classes outside the vision tower). The vision tower stays in the root unit: a process whose batch
    has no image would otherwise skip its units while another gathers them, and both would wait."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for n, m in model.named_modules() if type(m).__name__ in names and not is_vision(n)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)}): "
            "FSDP needs its layers to shard one by one"
        )
    return found


def shard(
    model: nn.Module,
    is_vision: Callable[[str], bool],
    *,
    mp_policy=None,
    offload_policy=None,
) -> nn.Module:
    """``fully_shard`` on each of ``units(model)`` then on ``model``, over the default process group (in
    place; the parameters become DTensor shards, so build the optimizer after this)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns that the root's output (Hugging Face's logits, a slice) is a view: an in-place op on it
    # would skip a backward hook. mmgrpo's scoring reads logits out of place, so the warning says nothing
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    kw = {}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    for unit in units(model, is_vision):
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    setattr(model, SHARDS_FLAG, True)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside the block every unit of ``model`` is whole on every process and stays whole through any
    number of forwards: no collective runs in a forward, so processes may decode different numbers of
    tokens and turns. (Gathering is one collective per unit on entry; every process enters together.)
    Not for training passes: gradients would not be reduce-scattered."""
    if not is_sharded(model):
        yield
        return
    mods = _fsdp_modules(model)  # model.modules() order: the same on every process
    model.set_reshard_after_forward(False)  # every unit, the root included
    for m in mods:
        m.unshard()
    setattr(model, SHARDS_FLAG, False)
    try:
        yield
    finally:
        setattr(model, SHARDS_FLAG, True)
        for m in mods:
            m.reshard()
        for m in mods:
            if m is not model:  # the root keeps its parameters after forward (FSDP2's own default)
                m.set_reshard_after_forward(True, recurse=False)


class Lockstep:
    """Rollouts on the shards, every process running as many forwards of the model (``model.fsdp_rollout:
    lockstep``): the memory-lean alternative to :func:`gathered`.

    Every forward of the model gathers each of its units in turn and drops the layers' again after, so a
    process holds one layer at a time (and the root unit), and any two forwards of the model issue the
    same collectives, whatever their inputs. So processes only have to run the same *number* of forwards:
    inside :meth:`rollout` each forward is preceded by one agreement (an all-reduce of "I still have a
    forward to run"), and a process whose episodes are all done keeps agreeing and running a one-token
    forward until no process has a real one left. (As Hugging Face's ``generate(synced_gpus=True)``, for any
    mix of turns, tokens and images.) The lean decode step and the image-feature cache read weights
    directly, so they step aside while the model holds shards (``mmgrpo.model.adapters.holds_shards``):
    decoding is slower per token, and every token gathers the whole model once.

    ``real`` and ``padding`` count this process's forwards of each kind (over every rollout)."""

    def __init__(self, model: nn.Module, pad_token_id: int, accelerator) -> None:
        self.model, self.pad_token_id, self.accelerator = model, pad_token_id, accelerator
        self.real = self.padding = 0
        self._draining = False

    def _agree(self, mine: int) -> int:
        """How many processes still have a forward to run (one all-reduce)."""
        return round(global_sum(self.accelerator, mine))

    def _before_forward(self, module, args, kwargs):
        if not self._draining:
            self.real += 1
            self._agree(1)

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """Forwards inside the block are counted and agreed; on leaving, this process runs one-token
        forwards until no process has a real one left. Every process enters, even with nothing to roll out."""
        # before FSDP's own pre-forward hook, so that the agreement comes before the unit's gathering
        handle = self.model.register_forward_pre_hook(self._before_forward, prepend=True, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
            self._drain()

    @torch.no_grad()
    def _drain(self) -> None:
        ids = torch.tensor([[self.pad_token_id]], device=self.accelerator.device)
        self._draining = True
        try:
            while self._agree(0):
                self.padding += 1
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        finally:
            self._draining = False


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors (a collective: every process calls it; each gets
    the full dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _sharded_state(model: nn.Module, optimizer, reference: nn.Module | None) -> dict:
    """The ``{"model", "optimizer", "reference"}`` state that :func:`save_sharded` writes and
    :func:`load_sharded` fills: each entry holds this process's shards (DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    return state


def save_sharded(path: Path, model: nn.Module, optimizer, reference: nn.Module | None) -> None:
    """Every process writes its shards of the model, the optimizer state and the reference under
    ``path / SHARDS_DIR`` (``torch.distributed.checkpoint``; a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer, reference), checkpoint_id=str(Path(path) / SHARDS_DIR))


def load_sharded(path: Path, model: nn.Module, optimizer, reference: nn.Module | None) -> None:
    """Put the shards saved by :func:`save_sharded` back into ``model``, ``optimizer`` and ``reference``
    (a collective; the same number of processes as when saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _sharded_state(model, optimizer, reference)
    dcp.load(state, checkpoint_id=str(Path(path) / SHARDS_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if reference is not None:
        set_model_state_dict(reference, state["reference"])


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t`` (a DTensor's local shard; a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this process holds of the parameters, their gradients and the optimizer state."""
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]

    def size(ts) -> int:
        return sum(local_tensor(t).numel() * t.element_size() for t in ts)

    return {"params": size(params), "grads": size(grads), "optimizer": size(states)}
