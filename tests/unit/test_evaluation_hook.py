"""shardlab-evaluate asks the task (Task.evaluation, issue #50 item 4): the command imports no task plug-in, a user's
task evaluates through the same hook, and one without it is told which hook to implement, in one line."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.errors import ConfigError
from shardlab.task import Evaluation, EvaluationRequest
from shardlab_commands import evaluate
from tests.unit.test_layout import imports, repo_imports

STILL_READING_TASKS = {"shardlab_commands.export_hf", "shardlab_commands.preprocess_lm"}
"""The commands that still import task modules (the LM's export and preprocessing), until they ask their task too;
shardlab-evaluate left this list when Task.evaluation came. None may join it."""


def task_readers(graph: dict[str, dict[str, int]]) -> dict[str, list[str]]:
    """Each module of shardlab_commands that imports a shardlab_tasks module (at module level or in a function), with
    what it imports."""
    found: dict[str, list[str]] = {}
    for module, targets in graph.items():
        if module.startswith("shardlab_commands"):
            tasks = sorted(t for t in targets if t == "shardlab_tasks" or t.startswith("shardlab_tasks."))
            if tasks:
                found[module] = tasks
    return found


def test_the_evaluate_command_imports_no_task_plugin():
    readers = task_readers(repo_imports())
    assert "shardlab_commands.evaluate" not in readers, readers.get("shardlab_commands.evaluate")
    joined = set(readers) - STILL_READING_TASKS
    assert not joined, f"commands importing task modules (ask the task through a Task hook instead): {joined}"


def test_the_command_check_finds_a_planted_task_import_inside_a_function(tmp_path):
    for package in ("shardlab_commands", "shardlab_tasks", "shardlab_tasks/lm", "shardlab_tasks/lm/corpus"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "shardlab_tasks" / "lm" / "corpus" / "data.py").write_text("")
    (tmp_path / "shardlab_commands" / "evaluate.py").write_text("def f():\n    return 1\n")
    assert task_readers(imports(tmp_path)) == {}
    (tmp_path / "shardlab_commands" / "evaluate.py").write_text(
        "def f():\n    from shardlab_tasks.lm.corpus import data\n"
    )
    assert task_readers(imports(tmp_path)) == {"shardlab_commands.evaluate": ["shardlab_tasks.lm.corpus.data"]}


# ---- a user's task ---------------------------------------------------------------------------------------------------
@pytest.fixture
def my_research(research_root):
    return research_root / "examples" / "my_research"


SPIRALS = ["task=spirals", "model.width=8", "model.num_blocks=1", "data.num_train=64", "data.num_valid=32"]


def test_a_plugin_task_without_the_hook_is_told_which_hook_to_implement(my_research):
    with pytest.raises(ConfigError) as e:
        evaluate.main(["--random-init", f"user_dir={my_research}", *SPIRALS])
    assert str(e.value) == (
        "task spirals offers no evaluation: shardlab-evaluate asks Task.evaluation for one; implement it to return "
        "a shardlab.task.Evaluation (docs/tutorial.md)"
    )


class Accuracy(Evaluation):
    """A user's evaluation: the task's own metrics over its validation split, and a record --out leaves out."""

    modes = ("perplexity",)  # an option of the command's; a user's evaluation may take any it has
    default_modes = ("perplexity",)
    report_leaves_out = ("points",)

    def evaluate(self, request: EvaluationRequest) -> dict:
        model, task = request.model(), request.data_task()
        task.prepare_data()
        points, arms = task.valid_dataset.points, task.valid_dataset.arms
        with torch.no_grad():
            _, sums = task.loss(model, (points, arms), torch.device("cpu"))
        figures = task.summarize({k: float(v) for k, v in sums.items()})
        return {"accuracy": figures["accuracy"], "points": len(arms), "split": request.settings.split}


def test_a_plugin_tasks_evaluation_gets_the_loaded_model_and_its_data(my_research, tmp_path, monkeypatch, capsys):
    from shardlab.registry import TASKS

    evaluate.composed_config([f"user_dir={my_research}", *SPIRALS])  # registers the plug-in
    monkeypatch.setattr(TASKS.get("spirals"), "evaluation", lambda self: Accuracy(self))
    out = tmp_path / "r.json"
    results = evaluate.main(["--random-init", f"user_dir={my_research}", *SPIRALS, "--out", str(out)])
    assert results["points"] == 32 and 0 <= results["accuracy"] <= 1 and results["split"] is None
    assert "evaluating the randomly initialised model (task spirals, random init seed" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["results"] == {"accuracy": results["accuracy"], "split": None}  # "points" left out
    with pytest.raises(ConfigError, match="is a spirals checkpoint; --knn needs a vision model; use --perplexity$"):
        evaluate.main(["--random-init", "--knn", f"user_dir={my_research}", *SPIRALS])


def test_a_checkpoints_starting_weights_file_is_dropped_only_where_it_shapes_nothing(tmp_path):
    """A vision run's model.pretrained (torchvision's trunk weights, in resumable_model_changes) is held by its
    checkpoint, so the file may be gone; an LM's folder gives its architecture and tokenizer, and stays."""
    from shardlab_tasks.image_classification.task import ImageClassificationTask
    from tests.conftest import TINY_LM, compose_config
    from tests.ssl_configs import TINY_VISION

    vision = compose_config(TINY_VISION)
    assert not evaluate.holds_its_starting_weights(vision)  # nothing to drop
    vision.model.pretrained = str(tmp_path / "gone.pth")
    assert "pretrained" in ImageClassificationTask.resumable_model_changes
    assert evaluate.holds_its_starting_weights(vision)
    lm = compose_config(TINY_LM)
    lm.model.pretrained = str(tmp_path / "hf_folder")
    assert not evaluate.holds_its_starting_weights(lm)
