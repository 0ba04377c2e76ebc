"""shardlab's user commands, installed on the PATH by ``pip install`` ([project.scripts] in pyproject.toml).

One command per tool, each named ``shardlab-<what it does>`` (as fairseq's ``fairseq-train``, ``fairseq-generate``):
each is its module's ``main`` with its own argparse ``--help``; training stays ``python -m shardlab.train``, which
Hydra's command line owns. They sit above ``shardlab`` and ``shardlab_tasks`` (tests/unit/test_layout.py): the
export and the preprocessing read the LM plug-in's own modules, which ``shardlab`` never imports; the evaluation asks
the task instead (Task.evaluation). ``python tools/<module>.py`` still runs each (tools/ keeps a two-line shim per
command, for a clone's habits and the recorded benchmark commands).
"""

COMMANDS = {
    "shardlab-export": "export_hf",
    "shardlab-generate": "generate",
    "shardlab-evaluate": "evaluate",
    "shardlab-preprocess": "preprocess_lm",
    "shardlab-consolidate": "consolidate",
    "shardlab-plot": "plot",
    "shardlab-sweep-summary": "sweep_summary",
}
"""Each command on the PATH and its module here (its ``cli`` is the entry point; pyproject.toml's [project.scripts]
lists the same, which tests/unit/test_commands.py holds to this)."""

__all__ = ["COMMANDS"]
