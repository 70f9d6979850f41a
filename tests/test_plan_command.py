"""``megapipe plan`` end to end: plan dir files, JSON output, byte-identical plan.yaml, one-line errors."""

from __future__ import annotations

import json
import os
import shlex

import yaml

from megapipe.cli import main

TINY = ["model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8"]
FILES = ("plan.yaml", "megatron_args.txt", "bridge_overrides.txt", "nemo2_overrides.txt", "nemo1_overrides.txt",
         "launch_megatron.sh", "launch_slurm.sbatch", "profile.yaml", "gantt.png", "memory.png")


def test_plan_json_and_plan_dir(tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["plan", *TINY, f"output.dir={out}", "output.format=json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) >= {"plans", "baseline", "search"}
    assert set(summary["search"]) >= {"evaluated", "pruned", "seconds"}
    best = summary["plans"][0]
    for key in ("parallel", "train", "schedule", "decoder_layers_per_stage", "layout", "step_time_s", "tokens_per_s_per_gpu",
                "mfu", "bubble_fraction", "stages", "memory_cv", "cost_per_million_tokens", "warnings"):
        assert key in best
    assert set(best["stages"][0]) >= {"time_ms", "static_bytes", "activation_bytes", "total_bytes"}
    assert best["parallel"]["tensor_model_parallel_size"] * best["parallel"]["pipeline_model_parallel_size"] \
        * best["parallel"]["data_parallel_size"] == 2
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    doc = yaml.safe_load((out / "plan.yaml").read_text())
    assert doc["format"] == "megapipe-plan/1"
    assert doc["topology"]["intra_node"]["kind"] == "loopback"
    assert doc["best"]["layout"] == best["layout"]
    args = shlex.split((out / "megatron_args.txt").read_text())
    assert args[args.index("--pipeline-model-parallel-size") + 1] == str(best["parallel"]["pipeline_model_parallel_size"])
    assert args == summary["emitted"]["megatron_args"] and "--bf16" in args and "--num-layers" in args
    assert summary["plan_dir"] == str(out) and str(out / "megatron_args.txt") in summary["files"]
    assert summary["seq_length_source"].endswith("default seq_length")
    assert summary["launch"].endswith(summary["emitted"]["megatron_command"])


def _stub(directory, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_launch_scripts_run_torchrun_with_the_plan(tmp_path, capsys):
    """Both launch scripts pass bash -n and, with torchrun, srun and scontrol stubbed, start torchrun with the node
    rank, the rendezvous, pretrain_gpt.py, every planned argument and the user's flags, in that order."""
    import subprocess

    out, stubs = tmp_path / "plan", tmp_path / "bin"
    stubs.mkdir()
    assert main(["plan", *TINY, f"output.dir={out}", "output.pictures=false"]) == 0
    capsys.readouterr()
    _stub(stubs, "torchrun", 'printf "%s\\n" "$CUDA_DEVICE_MAX_CONNECTIONS" "$@"\n')
    _stub(stubs, "scontrol", 'printf "node-a\\nnode-b\\n"\n')
    _stub(stubs, "srun", 'while [[ "$1" == --* ]]; do shift; done; exec "$@"\n')
    planned = shlex.split((out / "megatron_args.txt").read_text())
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "MEGATRON_LM": "/m", "NODE_RANK": "0",
           "MASTER_ADDR": "node-a", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node-[a-b]"}
    slurm = (out / "launch_slurm.sbatch").read_text()
    assert "#SBATCH --nodes=1" in slurm and "#SBATCH --gpus-per-node=2" in slurm  # cpu_gloo: 1 node of 2
    for name in ("launch_megatron.sh", "launch_slurm.sbatch"):
        subprocess.run(["bash", "-n", str(out / name)], check=True)
        run = subprocess.run(["bash", str(out / name), "--mock-data"], env=env, capture_output=True, text=True,
                             check=True)
        lines = run.stdout.splitlines()
        assert lines[1:] == ["--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0", "--master-addr", "node-a",
                             "--master-port", "6000", "/m/pretrain_gpt.py", *planned, "--mock-data"], name


def test_plan_yaml_is_byte_identical(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["plan", *TINY, f"output.dir={tmp_path / name}", "output.format=json",
                     "output.pictures=false"]) == 0
    capsys.readouterr()
    assert (tmp_path / "a" / "plan.yaml").read_bytes() == (tmp_path / "b" / "plan.yaml").read_bytes()


def test_plan_table_output(tmp_path, capsys):
    assert main(["plan", *TINY, f"output.dir={tmp_path}", "output.pictures=false"]) == 0
    text = capsys.readouterr().out
    assert "equal split" in text and "layout:" in text


def test_plan_table_is_readable_when_piped(monkeypatch, capsys):
    """Without a terminal or COLUMNS, rich would fold the columns into 80; the table keeps whole headers."""
    from megapipe.commands.plan import print_plans
    from megapipe.config import compose, to_scenario
    from megapipe.config.options import search_options
    from megapipe.plan.search import search

    monkeypatch.delenv("COLUMNS", raising=False)
    cfg = compose(TINY)
    scenario = to_scenario(cfg, search=True)
    result = search(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=scenario.fixed,
                    options=search_options(cfg))
    print_plans(result, scenario=scenario, directory="plan-dir")
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "tok/s/GPU" in line)
    assert all(name in header for name in ("TP/PP/DP/CP/VP", "schedule", "recompute", "peak GiB", "$/1M tok"))
    assert max(len(line) for line in lines if "│" in line or "┃" in line) <= 160  # the piped console's width
    assert any("equal split" in line and "%" in line for line in lines)


def test_plan_bad_input_is_one_line_exit_2(tmp_path, capsys):
    code = main(["plan", *TINY, "parallel.tensor_model_parallel_size=3", f"output.dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("megapipe plan: error:")
    assert main(["plan", *TINY, "train.global_batch_size=3", "train.micro_batch_size=2",
                 f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "global_batch_size" in err[0]


def test_submitit_launcher_composes():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from megapipe.config import conf_dir, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=["hydra/launcher=submitit_slurm", *TINY],
                      return_hydra_config=True)
    assert "submitit" in cfg.hydra.launcher._target_.lower()
    assert os.path.isdir(conf_dir())


def test_plan_ranks_what_megatron_runs_and_labels_what_ifs(tmp_path, capsys):
    """By default only 1f1b and interleaved_1f1b rank; search.what_if_schedules=true adds the others as what-ifs,
    and the files are written for the best plan megatron-core runs."""
    assert main(["plan", *TINY, f"output.dir={tmp_path / 'a'}", "output.format=json", "output.pictures=false"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {plan["schedule"] for plan in summary["plans"]} <= {"1f1b", "interleaved_1f1b"}
    assert not any(plan["what_if"] for plan in summary["plans"])
    what_if = ["search.what_if_schedules=true", "parallel.pipeline_model_parallel_size=2"]
    assert main(["plan", *TINY, *what_if, f"output.dir={tmp_path / 'b'}", "output.format=json",
                 "output.pictures=false"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not summary["best"]["what_if"] and summary["emitted"] is not None
    doc = yaml.safe_load((tmp_path / "b" / "plan.yaml").read_text())
    assert doc["best"]["schedule"] in ("1f1b", "interleaved_1f1b") and doc["emitted"]["layout"] == doc["best"]["layout"]


def test_plan_table_shows_megatron_schedule_warnings(tmp_path, capsys):
    """A pinned schedule megatron-core lacks is planned as a what-if: labelled, and no argument files are written."""
    assert main(["plan", *TINY, "schedule=zb_h1", "parallel.pipeline_model_parallel_size=2", f"output.dir={tmp_path}",
                 "output.pictures=false"]) == 0
    text = capsys.readouterr().out
    assert "warning: what-if: megatron-core has no zb_h1 schedule" in text and "zb_h1 (what-if)" in text
    assert "no Megatron arguments were written" in text
    assert not (tmp_path / "megatron_args.txt").exists() and not (tmp_path / "launch_megatron.sh").exists()
    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert doc["emitted"] is None and doc["best"]["what_if"]
    assert all(any("no zb_h1 schedule" in w for w in plan["warnings"]) for plan in doc["plans"])


def test_writeups_experiment_explains_their_configuration(capsys):
    """experiment=writeup_70b prints the write-ups' TP=4 PP=8 DP=4 next to the best plan, with where the time went;
    the defaults carry no such row (it is the write-ups' experiment, not every model's)."""
    from megapipe.commands.plan import compare_line
    from megapipe.config import compose, to_scenario
    from megapipe.config.options import search_options
    from megapipe.plan.search import search

    assert search_options(compose([])).reference is None
    cfg = compose(["+experiment=writeup_70b", "output.pictures=false"])
    scenario, options = to_scenario(cfg, search=True), search_options(cfg)
    result = search(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=scenario.fixed,
                    options=options, use_distributed_optimizer=scenario.parallel.use_distributed_optimizer)
    ref, best = result.reference, result.best
    assert (ref.parallel.tensor_model_parallel_size, ref.parallel.pipeline_model_parallel_size,
            ref.parallel.data_parallel_size) == (4, 8, 4)
    assert best.tokens_per_s >= ref.tokens_per_s
    line = compare_line(best, ref, options.reference)
    assert "reported 850 tok/s/GPU" in line and f"megapipe predicts {ref.tokens_per_s_per_gpu:,.0f}" in line
    assert f"{best.tokens_per_s / ref.tokens_per_s - 1:+.1%}" in line
    assert f"bubble {ref.bubble_fraction:.1%} -> {best.bubble_fraction:.1%}" in line


def test_equal_split_that_does_not_fit_is_flagged(tmp_path, capsys):
    """On the default 70B scenario without CP the best plan (TP4 PP8 VP6) has an equal split that needs more than
    the usable 71.6 GiB (with CP searched, the best plan's CP2 split fits)."""
    no_cp = "parallel.context_parallel_size=1"
    assert main(["plan", f"output.dir={tmp_path}", "output.pictures=false", "output.format=json", no_cp]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["baseline"]["feasible"] is False and summary["baseline"]["memory_over_gib"] > 0
    assert all(plan["feasible"] for plan in summary["plans"])
    assert main(["plan", f"output.dir={tmp_path / 't'}", "output.pictures=false", no_cp]) == 0
    text = capsys.readouterr().out
    peak = max(stage["total_bytes"] for stage in summary["baseline"]["stages"]) / 2**30
    assert f"{peak:.1f}!" in text and "! does not fit memory" in text and "the equal split does not fit memory" in text


def test_console_help_and_readme_name_the_files_the_plan_dir_holds(tmp_path, capsys):
    """One list (plandir.PLAN_DIR_FILES): the console's files line names what the dir holds, in its order, the
    pictures included; --help lists every file; README and docs/emit.md name each one, and no plan.log."""
    from megapipe.plandir import PLAN_DIR_FILES

    names = [name for name, _ in PLAN_DIR_FILES]
    assert main(["plan", *TINY, f"output.dir={tmp_path / 'p'}"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("files in"))
    held = sorted(path.name for path in (tmp_path / "p").iterdir())
    listed = line.split(": ", 1)[1].split(", .hydra/")[0].split(", ")
    assert sorted([*listed, ".hydra"]) == held and listed == [name for name in names if name in held]
    assert {"gantt.png", "memory.png", "launch_megatron.sh", "launch_slurm.sbatch", "profile.yaml"} <= set(listed)
    assert main(["plan", "--help"]) == 0
    help_lines = capsys.readouterr().out.splitlines()
    assert all(any(line.split()[:1] == [name] for line in help_lines) for name in names)
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    paragraph = readme[readme.index("Each `megapipe plan` writes its own directory"):].split("\n\n")[0]
    assert all(f"`{name}`" in paragraph for name in names) and ".log" not in paragraph
    with open(os.path.join(root, "docs", "emit.md"), encoding="utf-8") as handle:
        emit_doc = handle.read()
    assert all(f"`{name}`" in emit_doc.split("## The plan dir")[1].split("\n## ")[0] for name in names)


def test_dense_plan_yaml_leaves_out_moe_and_mla_fields(tmp_path, capsys):
    """A dense model's record has no MoE or MLA fields (model and inputs.model) and no MoE settings (inputs.parallel
    and inputs.train), and reads back to the same model, parallel and train records."""
    from omegaconf import OmegaConf

    from megapipe.config import compose, to_scenario
    from megapipe.features import MOE_SETTINGS
    from megapipe.records import MLA_MODEL_FIELDS, MOE_MODEL_FIELDS

    assert main(["plan", *TINY, f"output.dir={tmp_path}", "output.pictures=false", "output.format=json"]) == 0
    capsys.readouterr()
    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    for section in (doc["model"], doc["inputs"]["model"]):
        assert not (set(MOE_MODEL_FIELDS) | set(MLA_MODEL_FIELDS)) & set(section)
        assert section["num_layers"] == 4
    assert not set(MOE_SETTINGS) & (set(doc["inputs"]["parallel"]) | set(doc["inputs"]["train"]))
    read_back, composed = to_scenario(OmegaConf.create(doc["inputs"])), to_scenario(compose(TINY))
    assert (read_back.model, read_back.parallel, read_back.train) == (composed.model, composed.parallel, composed.train)
    mixtral = to_scenario(compose(["model=mixtral_8x7b"]), search=True).model
    assert mixtral.unused_fields == MLA_MODEL_FIELDS  # MoE without MLA: only the MLA fields go


def test_nemo1_file_says_why_nemo1_cannot_run_the_plan(tmp_path, capsys):
    """4 layers over PP 2 x VP 3 chunks: NeMo 1 has no layout key and cannot split them equally. Its file opens
    with the reason as a comment (the console warns too); the overrides follow on the next line."""
    assert main(["plan", *TINY, "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2",
                 "parallel.virtual_pipeline_model_parallel_size=3", f"output.dir={tmp_path}",
                 "output.pictures=false"]) == 0
    text = capsys.readouterr().out
    assert "warning: NeMo 1 has no per-stage key" in text and "so NeMo 1 will reject it" in text
    comment, overrides = (tmp_path / "nemo1_overrides.txt").read_text().splitlines()
    assert comment == ("# NeMo 1 cannot run this plan as planned: num_layers=4 does not divide over 6 model chunks "
                       "(no layout key), so NeMo 1 rejects these overrides")
    assert "model.virtual_pipeline_model_parallel_size=3" in shlex.split(overrides)
    assert not (tmp_path / "megatron_args.txt").read_text().startswith("#")
