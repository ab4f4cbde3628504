"""``mmgrpo.GRPO`` (TRL's model + reward functions + dataset), callbacks, grpo.epochs, the model card and
hub.push, end to end on the tiny text model (a few steps each)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import mmgrpo
from mmgrpo.errors import ConfigError, DataError

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]  # 9 rows
SMALL = dict(max_steps=2, num_generations=2, tasks_per_step=2, max_completion_length=6)


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    from mmgrpo.tiny.text import build_tiny_text_model

    return build_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "model")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class Recorder(mmgrpo.TrainerCallback):
    def __init__(self):
        self.events: list[tuple] = []

    def on_train_begin(self, trainer):
        self.events.append(("begin", trainer.step))

    def on_step_end(self, trainer, metrics):
        self.events.append(("step", metrics["step"], metrics["reward"]))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("evaluate", metrics["step"], metrics["eval_accuracy"]))

    def on_save(self, trainer, path):
        self.events.append(("save", Path(path).name))

    def on_train_end(self, trainer, metrics):
        self.events.append(("end", metrics["step"]))


def test_grpo_with_a_trl_reward_function_and_a_list_of_rows(text_model_dir, tmp_path):
    calls = []

    def brevity(prompts, completions, answer, **kwargs):  # TRL's signature; `answer` is a column
        calls.append((list(prompts), list(completions), list(answer)))
        return [-len(c) / 10 for c in completions]

    recorder = Recorder()
    out = tmp_path / "run"
    result = mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=[brevity],
        train_dataset=ROWS,
        output_dir=str(out),
        callbacks=[recorder],
        save_every=1,
        **SMALL,
    ).train(progress=False)
    # step 1 poses rows 0, 1 (G=2 each), step 2 rows 2, 3: the reward function saw the rows' own prompts
    # and answers, and plain-string completions (a standard, not conversational, dataset)
    assert len(calls) == 2
    assert calls[0][0] == [ROWS[0]["prompt"]] * 2 + [ROWS[1]["prompt"]] * 2
    assert calls[1][2] == [ROWS[2]["answer"]] * 2 + [ROWS[3]["answer"]] * 2
    assert all(isinstance(c, str) for c in calls[0][1])
    steps = [r for r in records(out)]
    assert [r["step"] for r in steps] == [1, 2]
    for call, r in zip(calls, steps, strict=True):  # the metrics are that function's rewards
        assert r["reward/brevity"] == pytest.approx(sum(-len(c) / 10 for c in call[1]) / 4)
    assert result.step == 2 and result.metrics == steps[-1]
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "README.md").is_file()
    # callbacks: begin, per step (a checkpoint after each: save_every=1), the final save, end
    assert recorder.events == [
        ("begin", 0),
        ("step", 1, steps[0]["reward"]),
        ("save", "checkpoint-1"),
        ("step", 2, steps[1]["reward"]),
        ("save", "checkpoint-2"),
        ("save", "final"),
        ("end", 2),
    ]
    # the run is an ordinary mmgrpo run: its config names the data file written under output_dir
    cfg = mmgrpo.load_config(out / "config.yaml")
    assert cfg.env.name == "text_qa" and Path(cfg.env.kwargs["path"]).parent == out / "data"
    assert [json.loads(line) for line in Path(cfg.env.kwargs["path"]).read_text().splitlines()] == ROWS


def test_conversational_rows_none_rewards_and_evaluation_callbacks(text_model_dir, tmp_path):
    """Conversational prompts give message completions; a None reward skips the sample (TRL); with an
    eval_dataset and eval_every=1, on_evaluate sees each held-out accuracy metrics.jsonl records."""
    seen = []

    def first_half(prompts, completions, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS]
    recorder = Recorder()
    out = tmp_path / "run"
    mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=first_half,
        train_dataset=rows,
        eval_dataset=rows[:2],
        output_dir=str(out),
        callbacks=[recorder],
        eval_every=1,
        eval_episodes=2,
        **SMALL,
    ).train(progress=False)
    assert seen[0][0] == rows[0]["prompt"]  # the row's messages, as TRL passes them
    assert seen[0][1][0]["role"] == "assistant" and isinstance(seen[0][1][0]["content"], str)
    steps = records(out)
    assert [r["reward_none"] for r in steps] == [2, 2] and [r["reward"] for r in steps] == [1.0, 1.0]
    evaluations = [e for e in recorder.events if e[0] == "evaluate"]
    assert evaluations == [("evaluate", r["step"], r["eval_accuracy"]) for r in steps]
    assert all(0.0 <= e[2] <= 1.0 for e in evaluations)


def test_grpo_keyword_errors_name_the_key(text_model_dir, tmp_path):
    def f(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(
        ConfigError, match=r"GRPO\(learning_rat=...\): not a config key. Did you mean 'learning_rate'\?"
    ):
        mmgrpo.GRPO(model=str(text_model_dir), reward_funcs=[f], train_dataset=ROWS, learning_rat=1e-3)
    with pytest.raises(ConfigError, match=r"'grpo.group_size' must be"):
        mmgrpo.GRPO(model=str(text_model_dir), reward_funcs=[f], train_dataset=ROWS, num_generations="x")
    with pytest.raises(DataError, match="rows need a 'prompt' column"):
        mmgrpo.GRPO(model=str(text_model_dir), reward_funcs=[f], train_dataset=[{"text": "hi"}])

    def format(completions, **kwargs):  # noqa: A001 - the name of a built-in verifier
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match="has the name of a registered verifier"):
        mmgrpo.GRPO(model=str(text_model_dir), reward_funcs=[format], train_dataset=ROWS)
    cfg = mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=[f],
        train_dataset=ROWS,
        learning_rate=1e-3,
        warm_start={"steps": 3},
        seed=5,
        push_to_hub=False,
        overrides=["eval.episodes=7"],
    ).config
    assert (cfg.grpo.lr, cfg.warm_start.steps, cfg.seed, cfg.hub.push, cfg.eval.episodes) == (
        1e-3,
        3,
        5,
        False,
        7,
    )


def test_epochs_count_the_steps_from_the_train_rows(text_model_dir, tmp_path):
    from mmgrpo.train.epochs import epoch_steps
    from mmgrpo.train.trainer import Trainer

    assert [epoch_steps(e, 9, 2) for e in (1, 2, 0.5, 0.1)] == [5, 9, 3, 1]  # ceil(e * 9 / 2), at least 1
    assert epoch_steps(1, 8, 2) == 4 and epoch_steps(3, 10, 5) == 6
    f = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    g = mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=f,
        train_dataset=ROWS,
        output_dir=str(tmp_path / "r"),
        num_train_epochs=2,
        tasks_per_step=2,
        num_generations=2,
        max_completion_length=2,
    )
    assert g.config.grpo.epochs == 2.0
    g.train_rows.write(tmp_path / "r" / "data", "train")
    trainer = Trainer(g.config, progress=False)
    assert trainer.cfg.grpo.steps == math.ceil(2 * 9 / 2) == 9
    assert trainer.scheduler is not None
    trainer.close()
    procedural = mmgrpo.load_config(None, ["model.path=x", "grpo.epochs=1", f"output_dir={tmp_path / 'p'}"])
    with pytest.raises(ConfigError, match=r"grpo.epochs=1: env 'counting' has no finite train split"):
        Trainer(procedural, progress=False)


def test_the_model_card_says_what_the_model_is(text_model_dir, tmp_path):
    from mmgrpo.train.model_card import card_metrics, model_card

    def correct(completions, answer, **kwargs):
        return [float(a in c) for c, a in zip(completions, answer, strict=True)]

    out = tmp_path / "run"
    result = mmgrpo.GRPO(
        model=str(text_model_dir), reward_funcs=[correct], train_dataset=ROWS, output_dir=str(out), **SMALL
    ).train(progress=False)
    card = (out / "final" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- mmgrpo\n- grpo\n")
    assert f"| base model | `{text_model_dir}` |" in card and "| task | env `text_qa`" in card
    assert "| rewards | `correct` (weight 1) |" in card
    assert "| recipe | 2 GRPO steps of 2 tasks x 2 episodes |" in card
    assert "## Final metrics (step 2)" in card
    last = records(out)[-1]
    assert f"| reward | {last['reward']:.4g} |" in card and f"| kl | {last['kl']:.4g} |" in card
    assert list(card_metrics(last))[:2] == ["reward", "reward/correct"]
    assert card == model_card(result.trainer.cfg, last)
    cfg = mmgrpo.load_config(None, ["model.path=Qwen/Qwen2.5-VL-3B-Instruct"])  # a hub id: linked as base
    assert "base_model: Qwen/Qwen2.5-VL-3B-Instruct\n" in model_card(cfg, {"step": 1, "reward": 0.5})


def test_push_to_hub_without_a_token_is_one_line_before_training(text_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token either
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    out = tmp_path / "run"
    g = mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        train_dataset=ROWS,
        output_dir=str(out),
        push_to_hub=True,
        hub_model_id="me/tiny",
        **SMALL,
    )
    assert g.config.hub.push and g.config.hub.repo_id == "me/tiny"
    with pytest.raises(
        ConfigError, match=r"^hub.push: true, but no Hugging Face token was found to push 'me/tiny'"
    ):
        g.train(progress=False)
    assert not (out / "metrics.jsonl").exists()  # nothing trained


def test_a_callback_stops_the_run_with_a_checkpoint_and_the_run_resumes(text_model_dir, tmp_path):
    class StopAfterOne(mmgrpo.TrainerCallback):
        def on_step_end(self, trainer, metrics):
            trainer.stop_requested = True

    f = lambda completions, **kw: [float(len(c) % 2) for c in completions]  # noqa: E731
    out = tmp_path / "run"
    g = mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=f,
        train_dataset=ROWS,
        output_dir=str(out),
        callbacks=[StopAfterOne],
        **SMALL,
    )
    with pytest.raises(mmgrpo.TrainingStopped) as stopped:
        g.train(progress=False)
    assert (
        stopped.value.step == 1 and stopped.value.path == out / "checkpoint-1" and stopped.value.signum == 0
    )
    g.callbacks = []
    result = g.train(resume=True, progress=False)
    assert result.step == 2 and [r["step"] for r in records(out)] == [1, 2]


def test_push_to_hub_uploads_the_final_folder_with_its_card(text_model_dir, tmp_path, monkeypatch):
    """With a token, the final folder (model, card) goes to hub.repo_id after training (the hub faked here:
    no network)."""
    import huggingface_hub

    pushed = []

    class FakeApi:
        def create_repo(self, repo_id, private, exist_ok):
            pushed.append(("create", repo_id, private, exist_ok))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, folder_path, repo_id, commit_message):
            pushed.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "run"
    f = lambda completions, **kw: [float(len(c) % 2) for c in completions]  # noqa: E731
    result = mmgrpo.GRPO(
        model=str(text_model_dir),
        reward_funcs=f,
        train_dataset=ROWS,
        output_dir=str(out),
        push_to_hub=True,
        hub_model_id="me/tiny",
        **SMALL,
    ).train(progress=False)
    assert result.hub_url == "https://huggingface.co/me/tiny"
    assert pushed[0] == ("create", "me/tiny", True, True)
    assert pushed[1][:2] == ("upload", "me/tiny") and {"README.md", "model.safetensors"} <= set(pushed[1][2])


def test_a_datasets_dataset_is_saved_and_read_as_its_rows(text_model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    seen = []

    def f(prompts, completions, answer, **kwargs):
        seen.append((list(prompts), list(answer)))
        return [float(len(c) % 2) for c in completions]

    out = tmp_path / "run"
    ds = datasets.Dataset.from_list(ROWS)
    result = mmgrpo.GRPO(
        model=str(text_model_dir), reward_funcs=f, train_dataset=ds, output_dir=str(out), **SMALL
    ).train(progress=False)
    path = Path(result.trainer.cfg.env.kwargs["path"])
    assert path.parent == out / "data" and path.is_dir()  # save_to_disk's folder, named by the fingerprint
    assert seen[0] == (
        [ROWS[0]["prompt"]] * 2 + [ROWS[1]["prompt"]] * 2,
        [ROWS[0]["answer"]] * 2 + [ROWS[1]["answer"]] * 2,
    )
    assert result.step == 2
