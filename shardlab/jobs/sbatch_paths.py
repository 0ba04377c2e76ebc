"""A submitit folder with a ``%`` in its path, as Slurm's ``--output`` and ``--error`` must be told it.

sbatch and srun read those two options as filename patterns (``%j`` the job id, ``%t`` the task, ``%A_%a`` an array's
ids, ``%%`` a literal ``%``), and submitit writes its folder into them as it is. A sweep over an absolute path is
named ``data.path=%2Fa%2Fb,...`` (shardlab.cli.run_names percent-escapes a slash), so its jobs' logs went to another
path than the folder submitit reads them from, and submitit failed every job for want of its log. Here each ``%`` of
the folder is doubled in those options only, in the submission file submitit writes; submitit's own reads and the
job's command line (``python -m submitit.core._submit <folder>``) keep the folder as it is.

The hook wraps submitit's private ``SlurmExecutor._make_submission_file_text`` (the one place its Slurm executor
makes the file's text; submitit 1.5); tests/unit/test_sbatch_paths.py fails if it changes, and tests/slurm/test_slurm.py
runs a sweep in such a folder on a real cluster.
"""

from __future__ import annotations

import re

OUTPUT_OPTIONS = re.compile(r"(--(?:output|error)[= ])('[^']*'|\S+)")
"""``--output=PATH`` on an ``#SBATCH`` line, ``--output PATH`` on the srun line; PATH shell-quoted where needed."""
FOLDER_TAGS = re.compile(r"%[jt]")
"""The patterns a submitit folder may itself hold (``.submitit/%j``: submitit fills them in for each job, and writes
an array's as ``%A_%a``): the folder's part before the first of them is what every output path starts with."""


def fixed_part(folder: str) -> str:
    """``folder`` up to its first FOLDER_TAGS pattern: the same for every job."""
    tag = FOLDER_TAGS.search(folder)
    return folder if tag is None else folder[: tag.start()]


def escape_output_options(text: str, folder: str) -> str:
    """The submission file ``text`` with each ``%`` of ``folder``'s fixed part doubled where an ``--output`` or
    ``--error`` path starts with it."""
    fixed = fixed_part(folder)
    if "%" not in fixed:
        return text

    def escape(match: re.Match) -> str:
        quote = "'" if match.group(2).startswith("'") else ""
        path = match.group(2).strip("'")
        if not path.startswith(fixed):
            return match.group(0)
        return f"{match.group(1)}{quote}{fixed.replace('%', '%%')}{path[len(fixed) :]}{quote}"

    return OUTPUT_OPTIONS.sub(escape, text)


def escape_slurm_output_paths() -> None:
    """Installs the escape on submitit's SlurmExecutor, once per process: on the class, because submitit submits a
    job array through a fresh SlurmExecutor it makes itself. Every folder is written as before unless the fixed part
    of it holds a ``%``, which Slurm misread for every user of submitit."""
    from submitit.slurm import slurm

    make_text = slurm.SlurmExecutor._make_submission_file_text
    if getattr(make_text, "escapes_output_paths", False):
        return

    def escaped(self, command: str, uid: str) -> str:
        return escape_output_options(make_text(self, command, uid), str(self.folder))

    escaped.escapes_output_paths = True
    slurm.SlurmExecutor._make_submission_file_text = escaped
