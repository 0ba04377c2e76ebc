"""A submitit folder with ``%`` in its path reaches sbatch's and srun's ``--output``/``--error`` escaped (``%%``),
and everything else in the submission file as it is (shardlab/jobs/sbatch_paths.py). Made by submitit's own Slurm
executor, no cluster needed: these tests fail if submitit's private hook points change."""

from __future__ import annotations

import re
import shlex

import pytest
import submitit

from shardlab.jobs.sbatch_paths import escape_output_options, escape_slurm_output_paths


def sbatch_reads(pattern: str) -> str:
    """The path sbatch makes of a filename pattern (the patterns submitit writes; ``%%`` a literal ``%``) for task 0
    of job 7, array task 3."""
    table = {"%%": "%", "%j": "7", "%t": "0", "%A": "7", "%a": "3"}
    return re.sub(r"%[%jtAa]", lambda m: table[m.group(0)], pattern)


def submission_text(folder, array: bool = False) -> str:
    """The file submitit writes for sbatch, as it makes it for a job array (a fresh SlurmExecutor of its own, its
    map_count set) or for one job."""
    escape_slurm_output_paths()
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(partition="debug", time=5)
    if array:
        executor.parameters["map_count"] = 4
    return executor._make_submission_file_text(executor._submitit_command_str, "u")


def output_paths(text: str) -> list[str]:
    sbatch = re.findall(r"^#SBATCH --(?:output|error)=(.*)$", text, flags=re.M)
    srun = shlex.split(next(line for line in text.splitlines() if line.startswith("srun ")))
    return sbatch + [srun[i + 1] for i, arg in enumerate(srun) if arg in ("--output", "--error")]


@pytest.mark.parametrize("array", [False, True])
def test_a_sweep_folder_named_after_an_absolute_path_is_where_sbatch_writes_the_logs(array, tmp_path):
    """The launcher's folder, ``<sweep>/.submitit/%j`` (conf/hydra/launcher/slurm.yaml's schema), for one job and
    for an array (whose paths submitit writes with ``%A_%a`` in place of ``%j``)."""
    sweep = tmp_path / "lm" / "data.path=%2Fa%2Fb,%2Fc%2Fd"
    text = submission_text(sweep / ".submitit" / "%j", array)
    paths = output_paths(text)
    assert len(paths) == 4, text  # #SBATCH --output, --error; srun --output, --error
    job = "7_3" if array else "7"
    for path in paths:
        assert sbatch_reads(path).startswith(f"{sweep}/.submitit/{job}/{job}_0_log."), path
    assert text.rstrip().endswith(f"_submit {sweep}/.submitit/%j")  # submitit reads the folder as it is


def test_a_folder_without_percent_is_written_as_submitit_writes_it(tmp_path):
    """And the escape is installed once however often it is asked for."""
    from submitit.slurm import slurm

    plain = tmp_path / "sweep" / ".submitit" / "%j"
    escape_slurm_output_paths()
    hooked = slurm.SlurmExecutor._make_submission_file_text
    escape_slurm_output_paths()
    assert slurm.SlurmExecutor._make_submission_file_text is hooked
    executor = submitit.SlurmExecutor(folder=plain)
    executor.update_parameters(partition="debug", time=5)
    text = executor._make_submission_file_text("cmd", "u")
    assert text == slurm._make_sbatch_string(command="cmd", folder=executor.folder, **executor.parameters)
    quoted = "srun --output '/a b%2F/%j_%t_log.out' --error /elsewhere%2F/x"
    assert (
        escape_output_options(quoted, "/a b%2F/%j") == "srun --output '/a b%%2F/%j_%t_log.out' --error /elsewhere%2F/x"
    )
