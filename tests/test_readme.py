"""The README is the front door (issue 54): at most 350 lines, no broken relative link, the install commands
the ones CI runs, and a five-minute tour whose commands run as written, in order, on a fresh clone.

The fast tests read the tour's code block and replay it on paper: each line is a real `mmgrpo` subcommand
with arguments its parser accepts, every config file exists, and every model or run folder a command reads
was made by an earlier line (the tour once probed `runs/tiny-model-sees` without building it). The slow
test runs the lines themselves (about 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo.cli.app import build_parser
from mmgrpo.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages this README's rewrite moved its lab notes to (their links are checked too)
MOVED_TO = ["results", "agents", "tools", "tiny_vlm", "grpo", "speed", "runs", "real_models"]
NO_PROGRESS = {"train", "eval", "probe"}  # the slow test adds --no-progress: bars only clutter its capture


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """The commands of a bash block, one a line, comments dropped; ``a && b`` is two commands."""
    out = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1 :]
    return out


def tour() -> list[list[str]]:
    blocks = code_blocks(section(README.read_text(), "A five-minute tour"), "bash")
    assert len(blocks) == 1, "the tour is one bash block"
    return commands(blocks[0])


def relative_links(path: Path) -> list[tuple[str, Path]]:
    """(link, resolved file) for every markdown link or image in ``path`` that is not a URL or an anchor."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.append((target, (path.parent / target.split("#")[0]).resolve()))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", text, re.M)
    }


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines; the rest belongs in docs/ (issue 54)"


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{name}.md" for name in MOVED_TO)])
def test_relative_links_point_at_files(page):
    links = relative_links(ROOT / page)
    assert links, f"{page} links nowhere"
    missing = [link for link, file in links if not file.exists()]
    assert not missing, f"{page}: broken links {missing}"
    for link, file in links:
        anchor = link.partition("#")[2]
        if anchor and file.exists():
            assert anchor in anchors(file), f"{page}: {link} names no heading of {file.name}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {file for _, file in relative_links(README)}
    for name in MOVED_TO:
        assert (ROOT / "docs" / f"{name}.md").resolve() in linked, (
            f"docs/{name}.md is not in the README's table"
        )


def test_install_commands_are_the_ones_ci_runs():
    two = code_blocks(section(README.read_text(), "Two commands"), "bash")[0]
    lines = [" ".join(c) for c in commands(two)]
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r"pip install --quiet (torch==\S+ torchvision==\S+)", ci).group(1)
    assert f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in lines
    assert "pip install -e ." in lines and "mmgrpo demo" in lines
    assert "pip install -e .[test]" in lines  # shlex drops the quotes of ".[test]"
    assert "python -m pytest -q" in lines
    assert re.search(r'pip install --quiet -e "\.\[test\]"', ci)
    assert re.search(r"^python3 -m pytest -q$", ci, re.M), ".ci/run runs the README's test command"


def test_tour_commands_parse_and_read_only_what_earlier_lines_made():
    parser = build_parser()
    made: set[str] = set()  # folders the tour's earlier lines write: models and runs

    def norm(path: str) -> str:
        return os.path.normpath(path)

    steps = tour()
    assert len(steps) >= 6
    for argv in steps:
        line = " ".join(argv)
        assert argv[0] == "mmgrpo", f"tour line is not an mmgrpo command: {line}"
        args = parser.parse_args(argv[1:])  # exits (SystemExit) on an unknown subcommand or flag
        config = getattr(args, "config", None)
        if config is not None:
            assert (ROOT / config).is_file(), f"{line}: no file {config}"
            cfg = load_config(ROOT / config, args.set)
            model = getattr(args, "model", None) or cfg.model.path
            assert norm(model) in made, (
                f"{line}: reads the model {model!r}, which no earlier tour line builds or trains"
            )
            if args.command == "train":
                made.update({norm(cfg.output_dir), norm(os.path.join(cfg.output_dir, "final"))})
        if args.command == "tiny-model":
            made.add(norm(args.out_dir))
        if args.command == "plot":
            assert norm(args.run_dir) in made, f"{line}: no earlier line writes the run {args.run_dir}"
    assert {"tiny-model", "probe", "train", "eval"} <= {argv[1] for argv in steps}


@pytest.mark.slow
def test_tour_runs_as_written(tmp_path):
    """Every tour line, in order, in a folder that holds only the repository's examples (a fresh clone's view)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for argv in tour():
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mmgrpo",
                *argv[1:],
                *(["--no-progress"] if argv[1] in NO_PROGRESS else []),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if argv[1] == "eval":
            assert re.search(r"^accuracy: \d\.\d{3} \(n=200\)$", done.stdout, re.M), done.stdout[-2000:]
        if argv[1] == "probe":
            assert "verdict:" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "runs" / "try" / "curves.png").is_file()


def test_readme_python_examples_run_and_pass_the_env_checker():
    """The env, verifier and tool examples of '## Your own environment, verifier or tool' as written."""
    import mmgrpo

    namespace: dict = {}
    for block in code_blocks(section(README.read_text(), "Your own environment, verifier or tool"), "python"):
        exec(compile(block, "<README.md>", "exec"), namespace)
    for name in ("AddEnv", "ShopEnv"):
        mmgrpo.check_env(namespace[name]())
    verifier = namespace["short_answer"](max_chars=3)
    assert callable(verifier)


def test_the_annotated_config_in_docs_loads(tmp_path):
    """docs/grpo.md's annotated config is a valid config (unknown keys would fail here)."""
    text = (ROOT / "docs" / "grpo.md").read_text()
    block = code_blocks(section(text, "A config, annotated"), "yaml")[0]
    (tmp_path / "c.yaml").write_text(block)
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.env.name == "counting" and cfg.grpo.steps > 0
