"""shardlab_bench/ssl_seeds.py: the self-supervised defaults over seeds, judged on the test split, as mean ± sd."""

from __future__ import annotations

import json

import pytest

from shardlab_bench import ssl_seeds

TINY = [  # a 2-step SimCLR of a ~3k-parameter trunk on 16 px images (tests/ssl_configs.py's shape)
    *("distributed=single", "distributed.world_size=1", "model.depth=2", "model.w_0=8", "model.w_a=8"),
    *("model.group_width=8", "model.stem_width=8", "data.image_size=16", "data.num_train=128", "data.num_valid=32"),
    *("data.num_test=64", "task.projection_dims=[32,16]", "optimization.batch_size=16", "optimization.max_steps=2"),
    *("lr_scheduler.warmup_steps=1", "validation.batch_size=16", "validation.num_batches=1"),
    *("checkpoint.interval_steps=0", "logging.tensorboard=false"),
]


def test_summary_is_the_mean_and_sample_standard_deviation_over_seeds():
    per_seed = {"1": {"linear_top1": 10.0, "linear_top5": 50.0, "knn_top1": 7.0}}
    per_seed["2"] = {"linear_top1": 20.0, "linear_top5": 50.0, "knn_top1": 8.0}
    per_seed["3"] = {"linear_top1": 30.0, "linear_top5": 50.0, "knn_top1": 12.0}
    s = ssl_seeds.summary(per_seed)
    assert s["linear_top1"] == {"mean": 20.0, "sd": 10.0, "n": 3}  # sqrt(((-10)^2 + 0 + 10^2) / 2)
    assert s["linear_top5"]["sd"] == 0.0 and s["knn_top1"] == {"mean": 9.0, "sd": 2.65, "n": 3}
    row = ssl_seeds.table({"methods": {"simclr": {"per_seed": per_seed, "summary": s, "steps": 270}}}).splitlines()[2]
    assert row.startswith("| SimCLR, 270 steps | 20.0 ± 10.0% | 50.0 ± 0.0% | 9.0 ± 2.6% | 10.0, 20.0, 30.0 |")


def test_one_seed_is_refused():
    with pytest.raises(SystemExit, match="at least 2 seeds"):
        ssl_seeds.main(["--seeds", "1"])


def test_a_variant_is_labelled_by_its_overrides_and_named_for_one_method_only():
    per_seed = {str(k): {"linear_top1": 60.0 + k, "linear_top5": 90.0, "knn_top1": 5.0} for k in (1, 2)}
    entry = {"task": "simclr", "overrides": ["task.projection_last_bn=true"], "per_seed": per_seed}
    entry["summary"] = ssl_seeds.summary(per_seed)
    entry["training"] = {"1": {"seconds": None, "note": "finished before this study: evaluated only"}}
    entry["training"]["2"] = {"seconds": 150.0}  # only a run trained by the study has a training time
    (row,) = ssl_seeds.rows({"methods": {"simclr_last_bn": entry}})
    label = "SimCLR (task.projection_last_bn=true)"
    assert row == f"| {label} | 61.5 ± 0.7% | 90.0 ± 0.0% | 5.0 ± 0.0% | 61.0, 62.0 | 2.5-2.5 min |"
    with pytest.raises(SystemExit, match="one method's variant"):
        ssl_seeds.main(["--methods", "simclr", "swav", "--name", "x"])


@pytest.mark.slow  # two training processes and four evaluations: ~100 s on 2 loaded cores
def test_a_study_trains_each_seed_and_judges_it_and_the_random_trunk_on_the_test_split(tmp_path):
    out = tmp_path / "study.json"
    ssl_seeds.main(["--methods", "simclr", "--seeds", "1", "2", "--runs", str(tmp_path / "runs"), "--out", str(out)]
                   + ["--", *TINY])  # fmt: skip
    study = json.loads(out.read_text())
    assert list(study["methods"]) == ["simclr", "random", "random_init_bn"]
    for name in ("simclr", "random"):
        entry = study["methods"][name]
        assert entry["summary"]["linear_top1"]["n"] == 2 and set(entry["per_seed"]) == {"1", "2"}
        evaluated = json.loads((tmp_path / "runs" / name / "seed_1" / "eval_test.json").read_text())
        assert evaluated["meta"]["settings"]["split"] == "test" and evaluated["results"] == entry["per_seed"]["1"]
    assert study["methods"]["simclr"]["steps"] == 2
    assert json.loads((tmp_path / "runs" / "random" / "seed_2" / "eval_test.json").read_text())["meta"]["settings"][
        "recompute_bn"
    ]


def test_a_screen_judges_one_seed_on_the_validation_split_and_shows_the_runs_own_loss_and_code_entropy():
    per_seed = {"1": {"linear_top1": 40.06, "linear_top5": 85.0, "knn_top1": 33.2}}
    entry = {"task": "swav", "overrides": ["task.epsilon=0.03"], "per_seed": per_seed, "steps": 270}
    entry["summary"] = ssl_seeds.summary(per_seed)
    entry["final"] = {"1": {"loss": 4.5216, "code_entropy": 4.4411}}
    entry["training"] = {"1": {"seconds": 265.0}}
    table = ssl_seeds.table({"methods": {"swav_eps03": entry}, "split": "valid"}).splitlines()
    assert table[0] == ssl_seeds.SCREEN_HEADER[0] and "validation split" in table[0]
    assert table[2] == "| SwAV (task.epsilon=0.03), 270 steps | 4.522 | 4.441 | 40.1% | 33.2% | 4.4-4.4 min |"
    base = ["optimization.max_steps=270", "task.warmup_temperature_steps=135"]
    entry["overrides"] = ["optimization.max_steps=270", "task.warmup_temperature_steps=90"]
    (row,) = ssl_seeds.screen_rows({"methods": {"warm90": entry}}, base)  # a screen names what it changes
    assert row.startswith("| SwAV (task.warmup_temperature_steps=90), 270 steps |")
    entry["overrides"] = base
    assert ssl_seeds.screen_rows({"methods": {"base": entry}}, base)[0].startswith("| SwAV (the base of these runs)")
    with pytest.raises(SystemExit, match="at least 2 seeds.*--split valid"):
        ssl_seeds.main(["--seeds", "1", "--split", "test"])
