"""The first hour's rough edges (issue #51): a dry run leaves nothing on disk."""

from __future__ import annotations


def test_a_dry_run_prints_its_plan_and_leaves_no_folder(tmp_path, cli_forks):
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    args = ["model=gpt_small", "dry_run=true", "distributed=fully_sharded", "distributed.world_size=4"]
    for extra in ([], ["hydra.run.dir=kept/a/b"]):
        done = cli_forks.run(*args, *extra, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "planned in" in done.stdout
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["kept"], extra


def plan_lines(capsys, *overrides: str) -> list[str]:
    from shardlab.runner import build_task, print_plan
    from tests.conftest import compose_config

    cfg = compose_config(["dry_run=true", *overrides])
    print_plan(cfg, build_task(cfg, world_size=1))
    return capsys.readouterr().out.splitlines()


def test_the_plan_names_the_attention_kernel_only_for_a_model_with_attention(capsys):
    assert any(line.startswith("  attention: ") for line in plan_lines(capsys))  # gpt_tiny
    assert not any("attention" in line for line in plan_lines(capsys, "task=image_classification"))  # RegNet


def test_the_plan_table_at_1024_ranks_shows_a_capacity_and_shares_that_read(capsys):
    import re

    from shardlab.memory.console import GiB, _capacity, _share

    world = ["distributed=fully_sharded", "distributed.world_size=1024", "optimization.batch_size=1024"]
    lines = plan_lines(capsys, *world, "validation.batch_size=1024", "model=gpt_small")
    (header,) = [line for line in lines if line.lstrip().startswith("layout ")]
    capacity = re.search(r" of (\S+)$", header).group(1)
    assert capacity not in ("0", "?") and float(capacity) > 0, header  # this machine's memory over 1024 ranks
    shares = [line.split()[-1] for line in lines if re.match(r"^[* ] (ddp|fully_sharded|hybrid)", line)]
    assert shares and all(s == ">999%" or (s.endswith("%") and len(s) <= 4) for s in shares), shares
    assert (_capacity(int(0.023 * GiB)), _capacity(int(1.5 * GiB)), _capacity(80 * GiB)) == ("0.023", "1.5", "80")
    assert (_share(50, 100), _share(999, 100), _share(1000, 100), _share(5, 0)) == ("50%", "999%", ">999%", "?")


def test_a_points_wall_time_counts_its_runs_not_the_time_between_them(tmp_path, monkeypatch):
    import time as clock

    from shardlab.jobs import run_record

    now = [1000.0]
    monkeypatch.setattr(clock, "time", lambda: now[0])
    run_record.start(tmp_path, ["seed=1"], 10)
    now[0] += 76.0
    run_record.update(tmp_path, step=5)  # ran 76 s, then stopped
    assert run_record.run_seconds(run_record.read(tmp_path)) == 76.0
    now[0] += 850.0  # idle until the rerun
    run_record.start(tmp_path, ["seed=1"], 10)
    now[0] += 4.0
    run_record.finish(tmp_path, {"final": {"loss": 1.0}})
    status = run_record.read(tmp_path)
    assert run_record.run_seconds(status) == 80.0 and status["started"] == 1000.0
    old = {"started": 10.0, "updated": 40.0}  # a status.json written before attempt_started: one start
    assert run_record.run_seconds(old) == 30.0 and run_record.run_seconds({}) is None
