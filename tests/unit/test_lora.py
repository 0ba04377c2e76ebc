"""model.lora: shardlab's LoRA layers compute what peft computes on the transformers model, only the adapters train,
and the adapters leave as a peft folder or merged into the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.errors import CheckpointError, ConfigError
from shardlab.optim import OPTIMIZERS
from shardlab.runner import build_task
from shardlab_tasks.lm.hf.peft import write_peft_adapter
from shardlab_tasks.lm.models.lora import LoRALinear, is_adapter, merge_lora
from tests.hf_folders import make_folder

SEQ = 16
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_folder(family, root / family) for family in ("llama3", "qwen2", "qwen3", "gpt2")}


def task_of(folder: Path | None, *overrides: str):
    source = [f"model.pretrained={folder}"] if folder else ["model=llama_tiny"]
    cfg = compose_config([*source, f"data.seq_len={SEQ}", *overrides])
    return build_task(cfg, world_size=1)


def loaded(task, seed: int = 0) -> torch.nn.Module:
    """Built on meta, materialized, the folder read in; then the adapters set to random values (B = 0 at init would
    make any adapter computation look right)."""
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    task.load_pretrained(model, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}


def tokens() -> torch.Tensor:
    return torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama3", "[attn.*,mlp.down]"), ("qwen2", "[attn.q,attn.v]"), ("gpt2", "[attn.*,mlp.fc]")],
)
def test_saved_adapter_loads_in_peft_on_the_transformers_model_with_equal_logits(folders, tmp_path, family, targets):
    import peft
    import transformers

    task = task_of(folders[family], *LORA, f"model.lora.target_modules={targets}")
    model = loaded(task)
    assert any(isinstance(m, LoRALinear) for m in model.modules())
    folder = write_peft_adapter(adapters(model), task.cfg.model, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, folder).eval()
    x = tokens()
    with torch.no_grad():
        ours, expected = model(x), theirs(input_ids=x).logits
    assert not torch.allclose(ours, reference_without_adapters(task, x), atol=1e-3)  # the adapters do something
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def reference_without_adapters(task, x: torch.Tensor) -> torch.Tensor:
    """The same folder's model with model.lora.rank=0: the base alone."""
    base = task_of(Path(task.cfg.model.pretrained))
    with torch.no_grad():
        return loaded(base)(x)


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_merged_weights_compute_what_the_adapted_model_computes(folders, family):
    task = task_of(folders[family], *LORA, "model.lora.target_modules=[attn.*,mlp.*]")
    model = loaded(task)
    merged = merge_lora(model.state_dict(), task.cfg.model)
    assert not any(is_adapter(k) for k in merged)
    plain = model_on_meta(task_of(folders[family]))
    plain.load_state_dict(merged, assign=True)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_lora_model_starts_as_its_base_and_only_adapters_get_gradients_and_optimizer_state(folders):
    task = task_of(folders["llama3"], *LORA)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    task.load_pretrained(model, torch.device("cpu"))
    x = tokens()
    with torch.no_grad():  # B = 0 at init (peft's init): the adapted model is the base
        torch.testing.assert_close(model(x), reference_without_adapters(task, x), rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert {n.rsplit(".", 2)[0] for n in trainable} == {f"blocks.{i}.attn.{p}" for i in (0, 1) for p in "qkvo"}
    optimizer = OPTIMIZERS.build("adamw", model, task.cfg.optimizer)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    task.loss(model, torch.cat([x, x[:, :1]], 1), torch.device("cpu"))[0].backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
    assert task.checkpointed_keys()("blocks.0.attn.q.lora_A.weight")
    assert not task.checkpointed_keys()("blocks.0.attn.q.weight")
    assert task_of(folders["llama3"]).checkpointed_keys() is None  # LoRA off: checkpoints hold everything


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.rank=-1"], r"model.lora.rank must be >= 0 \(0 = LoRA off\), got -1"),
        (["model.lora.rank=4", "model.lora.target_modules=[attn.qkv]"], r"'attn.qkv' matches no linear layer"),
        (["model.lora.rank=4", "model.lora.alpha=0"], r"model.lora.alpha must be > 0"),
        (["model.lora.rank=4", "model.lora.dropout=1.0"], r"model.lora.dropout must be in \[0, 1\)"),
    ],
)
def test_lora_config_mistakes_are_refused_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        task_of(None, *overrides)


LLAMA31_8B = Path(__file__).parents[1] / "data" / "llama3_1_8b"
H100_8 = [
    "distributed=fully_sharded", "distributed.world_size=8", "distributed.plan_device=h100_80gb",
    "distributed.precision=bf16", "data.seq_len=4096", "optimization.batch_size=8", "validation.batch_size=8",
    "dry_run=true",
]  # fmt: skip


def test_llama_3_1_8b_plans_for_8_h100s_with_lora_and_counts_grads_and_optimizer_of_the_adapters_only(capsys):
    from shardlab.memory.estimate import collectives
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import one_profile_per_run, plan_run, profile_config
    from shardlab.runner import print_plan

    lora = ["model.lora.rank=16", "model.lora.target_modules=[attn.*,mlp.*]"]
    plans, sent, ctx = {}, {}, None
    with one_profile_per_run():  # as a run does: each 8B model's meta forward profiled once, not by every caller
        for name, extra in (("full", []), ("lora", lora)):
            task = task_of(LLAMA31_8B, *H100_8, *extra)
            plans[name] = plan_run(task.cfg, task, 8, model_on_meta(task)).estimate
            profile, ctx = profile_config(task.cfg, task, 8, model_on_meta(task))
            for c in collectives(profile, layout_of(task.cfg.distributed, 8), ctx):  # each op's input over 8 ranks
                sent[name, c.op] = sent.get((name, c.op), 0) + c.bytes * c.group_size * c.count
        print_plan(task.cfg, task)
    assert "h100_80gb" in capsys.readouterr().out
    full, lora_plan = plans["full"], plans["lora"]
    # 8.03B base; per layer, rank 16 times (in + out) of q, o (4096, 4096), k, v (4096, 1024), gate, up, down (4096,
    # 14336): 1,310,720 adapter parameters, 32 layers.
    adapters = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert adapters == 41_943_040
    assert lora_plan.params > full.params  # the base is all there, sharded, plus the adapters
    assert lora_plan.optimizer == pytest.approx(8 * adapters / 8, rel=0.01)  # two fp32 Adam moments, 1/8 per rank
    assert lora_plan.grads == pytest.approx(4 * adapters / 8, rel=0.01)
    assert full.optimizer > 100 * lora_plan.optimizer and full.grads > 100 * lora_plan.grads
    assert lora_plan.peak < full.peak - (full.optimizer + full.grads) // 2
    # The all-gathers carry every parameter (the base and the adapters); the reduce-scatters the adapters' gradients
    # alone, in the reduce dtype (FSDP2 reduces the gradients it has).
    assert sent["lora", "all_gather"] == pytest.approx(sent["full", "all_gather"] * (1 + adapters / 8.03e9), rel=1e-3)
    assert sent["lora", "reduce_scatter"] == pytest.approx(adapters * ctx.reduce_bytes, rel=0.01)
    assert lora_plan.comm_bytes < 0.7 * full.comm_bytes
    # gathered: the largest unsharded gradient and reduce-scatter buffer, the token embedding's unit's (128256 x 4096)
    # for full fine-tuning, become a layer's adapters' (all else equal but the adapters' all-gathered copies)
    biggest, layer_adapters = 128_256 * 4096, adapters // 32
    saved = (ctx.param_bytes + ctx.reduce_bytes) * (biggest - layer_adapters)
    assert full.gathered - lora_plan.gathered == pytest.approx(saved, rel=0.01)


# ---- the merged export of a LoRA step folder: streamed, base from model.pretrained, adapters folded in --------------
@pytest.fixture(scope="module")
def lora_runs(folders, tmp_path_factory, corpus_cache) -> dict[str, Path]:
    """family -> the step folder of a 2-step LoRA run (adapters only) from that family's folder; lr high enough that
    B is far from 0."""
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank
    from tests.conftest import TINY_LM

    root = tmp_path_factory.mktemp("lora_runs")
    steps = {}
    for family, targets in (
        ("llama3", "[attn.*,mlp.*]"),
        ("qwen2", "[attn.q,attn.v,mlp.down]"),
        ("gpt2", "[attn.*,mlp.*]"),
    ):
        run = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"model.pretrained={folders[family]}", *LORA]
        run += [f"model.lora.target_modules={targets}", "optimization.max_steps=2", "checkpoint.interval_steps=2"]
        run += ["optimizer.lr=1e-2", "validation.interval_steps=0"]
        run_rank(compose_config(run), root / family, dist_env.detect())
        steps[family] = root / family / "checkpoints" / "step_00000002"
    return steps


def trained(step: Path):
    """The LoRA run's model as it trained (its base from model.pretrained, its adapters from the step folder)."""
    from omegaconf import OmegaConf

    from shardlab.checkpoint import weights

    cfg = OmegaConf.create(weights.describe(step)["config"])
    task = build_task(cfg, world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    task.load_pretrained(model, torch.device("cpu"))
    saved = weights.read_full(step)
    assert saved and all(is_adapter(k) for k in saved)  # the step folder: adapters only
    model.load_state_dict(saved, strict=False)
    return task, model.eval()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2"])
def test_merged_export_of_a_lora_step_folder_loads_in_transformers_with_the_trained_models_logits(
    lora_runs, folders, family, tmp_path
):
    import peft
    import transformers

    from shardlab_commands import export_hf

    step = lora_runs[family]
    out = export_hf.main(
        [str(step), "--out", str(tmp_path / "merged"), "--max-shard-mb", "0.05", "--buffer-mb", "0.01"]
    )
    assert len(list(out.glob("*.safetensors"))) >= 3 and not (out / "adapter_config.json").exists()
    adapter = export_hf.main([str(step), "--adapter-only", "--out", str(tmp_path / "adapter")])
    task, model = trained(step)
    x = tokens()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model(x), merged(input_ids=x).logits
        with_peft = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=x).logits
        assert not torch.allclose(ours, reference_without_adapters(task, x), atol=1e-3)  # the adapters trained
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(theirs, with_peft, rtol=1e-4, atol=1e-5)


def test_lora_export_options_and_a_missing_base_are_refused_in_one_line(lora_runs, folders, tmp_path, monkeypatch):
    from shardlab_commands import export_hf

    step = str(lora_runs["llama3"])
    gone = tmp_path / "moved_away"
    with pytest.raises(ConfigError, match=rf"--base={gone}, the frozen base of this LoRA run .* is not there"):
        export_hf.main([step, "--base", str(gone), "--out", str(tmp_path / "a")])
    with pytest.raises(ConfigError, match="--adapter-only writes the step folder's adapters as saved; drop --base"):
        export_hf.main([step, "--adapter-only", "--base", str(folders["llama3"]), "--out", str(tmp_path / "b")])
    with pytest.raises(CheckpointError, match=r"the frozen base .*qwen3 is not the one .* trained its adapters on"):
        export_hf.main([step, "--base", str(folders["qwen3"]), "--out", str(tmp_path / "c")])  # another shape
    with monkeypatch.context() as m:  # a checkpoint older than the base's digest: the shapes still catch it
        m.setattr(export_hf, "base_refusal", lambda *args: None)
        with pytest.raises(
            CheckpointError,
            match=r"the adapters of blocks.0.attn.k \(\[4, 64\], \[32, 4\]\) do not fit blocks.0.attn.k.weight "
            r"\[64, 64\] in .*qwen3; is that the run's base",
        ):
            export_hf.main([step, "--base", str(folders["qwen3"]), "--out", str(tmp_path / "c")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    # --base for a folder that moved: the same export as from model.pretrained
    moved = export_hf.main([step, "--base", str(folders["llama3"]), "--out", str(tmp_path / "moved")])
    original = export_hf.main([step, "--out", str(tmp_path / "original")])
    for file in sorted(original.glob("*.safetensors")):
        assert (moved / file.name).read_bytes() == file.read_bytes(), file.name


def test_lora_base_refuses_the_seeded_init_and_adapter_only_a_run_without_lora(lora_runs, tmp_path):
    from shardlab_tasks.lm.hf.export_hf import lora_base

    with pytest.raises(ConfigError, match="base is the seeded init .* export the adapters alone with --adapter-only"):
        lora_base({"model": {"pretrained": None}, "checkpoint": {"init_from": None}}, None)
    with pytest.raises(ConfigError, match=r"model.pretrained=.*nowhere, the frozen base .* pass --base"):
        lora_base({"model": {"pretrained": str(tmp_path / "nowhere")}, "checkpoint": {"init_from": None}}, None)


# ---- a step folder used with other LoRA settings: refused before any tensor is read, naming model.lora.* -----------
def start(run_dir: Path, corpus_cache: str, *overrides: str) -> None:
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank
    from tests.conftest import TINY_LM

    run = [*TINY_LM, f"data.cache_dir={corpus_cache}", "optimization.max_steps=1", "checkpoint.interval_steps=1"]
    run_rank(compose_config([*run, "validation.interval_steps=0", *overrides]), run_dir, dist_env.detect())


def test_a_step_folder_with_other_lora_settings_is_refused_in_one_line_naming_the_key(
    lora_runs, folders, tmp_path, corpus_cache
):
    lora_step, pretrained = lora_runs["llama3"], f"model.pretrained={folders['llama3']}"
    adapters = r"model.lora.rank=4 'model.lora.target_modules=\[attn.\*,mlp.\*\]'"
    cases = [
        ([pretrained, f"checkpoint.resume={lora_step}"], rf"holds a LoRA run's adapters only \({adapters}\), but this "
         rf"run has model.lora.rank=0: set {adapters} to resume it, or train the whole model from its merged export"),
        ([pretrained, f"checkpoint.resume={lora_step}", *LORA, "model.lora.rank=8", "model.lora.target_modules=[*]"],
         r"holds adapters of model.lora.rank=4, but this run has model.lora.rank=8: set model.lora.rank=4 "),
        ([pretrained, f"checkpoint.resume={lora_step}", *LORA, "model.lora.target_modules=[attn.*]"],
         r"holds adapters of model.lora.target_modules=\['attn.\*', 'mlp.\*'\], but this run has "),
    ]  # fmt: skip
    start(tmp_path / "seeded_lora", corpus_cache, *LORA)
    start(tmp_path / "full", corpus_cache)
    seeded_lora, full = (tmp_path / name / "checkpoints" / "step_00000001" for name in ("seeded_lora", "full"))
    cases += [
        ([f"checkpoint.init_from={seeded_lora}"], r"checkpoint.init_from: .* holds a LoRA run's adapters only, not a "
         r"model's weights; begin from its merged export \(shardlab-export .* --out DIR"),
        ([f"checkpoint.resume={full}", *LORA], r"was saved without LoRA \(model.lora.rank=0\) and holds no adapters, "
         r"but this run has model.lora.rank=4: put new adapters on its weights with checkpoint.init_from="),
    ]  # fmt: skip
    for i, (overrides, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            start(tmp_path / f"refused{i}", corpus_cache, *overrides)
    start(tmp_path / "alpha", corpus_cache, pretrained, f"checkpoint.resume={lora_step}", *LORA,
          "model.lora.target_modules=[attn.*,mlp.*]", "model.lora.alpha=2", "optimization.max_steps=3")  # fmt: skip
    assert (tmp_path / "alpha" / "checkpoints" / "step_00000003").is_dir()  # alpha may change: resumed
