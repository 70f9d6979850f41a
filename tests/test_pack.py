"""megapipe pack: the exact packing against brute force, the timeline, the what-if, the CLI and its errors."""

from __future__ import annotations

import itertools
import math
import subprocess

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megapipe.cli import main
from megapipe.errors import InfeasibleError
from megapipe.pack import Option, solve_brute, solve_dp, solve_milp
from megapipe.pack.solve import solve_packing, uses_dp
from megapipe.pack.timeline import run_timeline
from megapipe.records import JobSpec, ModelSpec, TrainSpec

MODEL = ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128, vocab_size=256,
                  seq_length=16)


def _job(name: str, *, weight: float = 1.0, tokens: float = 0.0, deadline: float | None = None) -> JobSpec:
    return JobSpec(name=name, model=MODEL, train=TrainSpec(), tokens=tokens, deadline_hours=deadline, weight=weight)


def _option(group: int, nodes: int, tokens_per_s: float) -> Option:
    return Option(group=group, nodes=nodes, tokens_per_s=tokens_per_s, flops_per_s=tokens_per_s * 1e9, plan=None,
                  result=None)


@st.composite
def instances(draw, *, groups: int = 1):
    """Jobs with concave-ish or arbitrary throughput curves over a few node counts per group."""
    num_jobs = draw(st.integers(1, 4))
    capacities = tuple(draw(st.integers(2, 8)) for _ in range(groups))
    jobs, options = [], []
    for j in range(num_jobs):
        jobs.append(_job(f"j{j}", weight=draw(st.sampled_from([0.5, 1.0, 2.0])),
                         tokens=draw(st.sampled_from([1e9, 4e9, 1e10])),
                         deadline=draw(st.sampled_from([1.0, 5.0, 20.0]))))
        opts = []
        for group in range(groups):
            for nodes in sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=3))):
                opts.append(_option(group, nodes, draw(st.integers(1, 50)) * 1e4 * nodes ** 0.8))
        options.append(opts)
    return jobs, options, capacities


def _flops(jobs, options, choice) -> float:
    return math.fsum(job.weight * opts[o].flops_per_s for job, opts, o in zip(jobs, options, choice))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2]).flatmap(lambda groups: instances(groups=groups)),
       st.sampled_from(["throughput", "makespan", "deadlines"]))
def test_dp_and_milp_equal_brute_force_on_every_objective(instance, objective):
    """The objective's optimum, then (makespan, deadlines) the most weighted FLOP/s among its optima: both solvers,
    on one node group and two."""
    jobs, options, capacities = instance
    brute = solve_brute(jobs, options, capacities, objective=objective)
    if brute is None:
        for solver in (solve_milp, solve_dp, solve_packing):
            with pytest.raises(InfeasibleError):
                solver(jobs, options, capacities, objective=objective)
        return
    for solver in (solve_milp, solve_dp):
        found = solver(jobs, options, capacities, objective=objective)
        assert found.value == pytest.approx(brute.value, rel=1e-9)
        assert _flops(jobs, options, found.choice) == pytest.approx(_flops(jobs, options, brute.choice), rel=1e-9)
        used = [0] * len(capacities)
        for j, o in enumerate(found.choice):
            used[options[j][o].group] += options[j][o].nodes
        assert all(u <= c for u, c in zip(used, capacities))
    assert solve_packing(jobs, options, capacities, objective=objective) == solve_dp(jobs, options, capacities,
                                                                                     objective=objective)


def test_dp_counts_met_weight_exactly():
    """Jobs a and b (weights 0.1 and 0.2) meeting their deadlines weigh what c (0.3) does, though 0.1 + 0.2 is
    0.30000000000000004 in floats: a tie the FLOP/s settle (c on 3 nodes), as the MILP settles it."""
    jobs = [_job("a", weight=0.1, tokens=3.6e9, deadline=1.0), _job("b", weight=0.2, tokens=3.6e9, deadline=1.0),
            _job("c", weight=0.3, tokens=3.6e9, deadline=1.0)]
    slow, fast = _option(0, 1, 1e5), _option(0, 2, 1e6)  # 10 h and 1 h for 3.6e9 tokens
    options = [[slow, fast], [slow, fast], [slow, _option(0, 3, 5e6)]]
    assert 0.1 + 0.2 != 0.3
    found = solve_dp(jobs, options, (5,), objective="deadlines")
    assert found.choice == solve_milp(jobs, options, (5,), objective="deadlines").choice == (0, 0, 1)
    assert found.value == 0.3


def test_the_packing_goes_to_the_milp_only_for_a_what_if_or_a_large_table():
    jobs = [_job("a"), _job("b")]
    options = [[_option(0, 2, 2e5), _option(0, 4, 3.9e5)], [_option(0, 2, 2e5), _option(0, 4, 4e5)]]
    assert uses_dp((6,)) and uses_dp((255, 255)) and not uses_dp((256, 256)) and not uses_dp((40, 40, 40))
    assert solve_packing(jobs, options, (6,)) == solve_dp(jobs, options, (6,))
    previous = [(0, 4), (0, 2)]
    assert solve_packing(jobs, options, (6,), previous=previous) == solve_milp(jobs, options, (6,), previous=previous)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.data())
def test_what_if_moves_the_fewest_jobs_among_optimal_packings(instance, data):
    jobs, options, capacities = instance
    first = solve_brute(jobs, options, capacities)
    if first is None:
        return
    previous = [(options[j][o].group, options[j][o].nodes) for j, o in enumerate(first.choice)]
    lost = data.draw(st.integers(1, capacities[0] - 1))
    after = (capacities[0] - lost,)
    optimum = solve_brute(jobs, options, after)
    if optimum is None:
        return
    fewest = min(
        sum((options[j][o].group, options[j][o].nodes) != previous[j] for j, o in enumerate(choice))
        for choice in itertools.product(*(range(len(opts)) for opts in options))
        if sum(options[j][o].nodes for j, o in enumerate(choice)) <= after[0]
        and math.fsum(jobs[j].weight * options[j][o].flops_per_s for j, o in enumerate(choice))
        >= optimum.value * (1 - 1e-9))
    repack = solve_milp(jobs, options, after, previous=previous)
    assert repack.value == pytest.approx(optimum.value, rel=1e-9)
    assert repack.moves == fewest


def test_move_slack_trades_throughput_for_fewer_moves():
    jobs = [_job("a"), _job("b")]
    options = [[_option(0, 2, 2e5), _option(0, 4, 3.9e5)], [_option(0, 2, 2e5), _option(0, 4, 4e5)]]
    first = solve_milp(jobs, options, (6,))
    assert first.choice == (0, 1)  # b gets 4 nodes
    previous = [(0, 4), (0, 2)]  # as if a had had 4 before
    exact = solve_milp(jobs, options, (6,), previous=previous)
    slack = solve_milp(jobs, options, (6,), previous=previous, slack=0.02)  # staying gives 5.9 of 6.0
    assert exact.moves == 2 and slack.moves == 0


def test_jobs_that_cannot_share_the_cluster_are_refused_with_the_need():
    jobs = [_job("a"), _job("b")]
    options = [[_option(0, 4, 1e5)], [_option(0, 4, 1e5)]]
    with pytest.raises(InfeasibleError, match="need 8 nodes together and the cluster has 6"):
        solve_milp(jobs, options, (6,))
    with pytest.raises(InfeasibleError, match="job 'b'"):
        solve_milp(jobs, [options[0], []], (6,))


def test_timeline_gives_finished_jobs_nodes_to_the_others():
    """a (1e9 tokens) and b (4e9) share 4 nodes 2 + 2; when a finishes, b gets all 4 after a restart."""
    jobs = [_job("a", tokens=3.6e9), _job("b", tokens=3.6e10)]
    options = [[_option(0, 2, 1e6), _option(0, 4, 2e6)], [_option(0, 2, 1e6), _option(0, 4, 2e6)]]
    state = {"calls": 0}

    def decide(active):
        state["calls"] += 1
        if len(active) == 2:
            return [options[0][0], options[1][0]]
        return [options[active[0]][1]]

    run = run_timeline(jobs, decide, peak=4e6 * 1e9, restart_h=0.5)
    finish = run.finish_h
    assert finish[0] == pytest.approx(1.0)  # 3.6e9 tokens at 1e6/s
    # b: 3.6e9 done in the first hour, 3.24e10 left at 2e6/s after a 0.5 h restart
    assert finish[1] == pytest.approx(1.0 + 0.5 + 3.24e10 / 2e6 / 3600)
    assert run.repacks == 1 and run.restarts == 1
    done = 2 * 1e6 * 1e9 * 3600 + 2e6 * 1e9 * (finish[1] - 1.5) * 3600
    assert run.average_utilisation == pytest.approx(done / (4e6 * 1e9 * finish[1] * 3600))
    assert run.average_weighted_flops_per_s == pytest.approx(done / (finish[1] * 3600))  # both weights 1
    # the segments the picture draws: a and b on 2 nodes each for an hour, then b on 4 after its restart
    assert [(s.job, s.nodes, s.start_h, s.restart_h) for s in run.segments] == [
        (0, 2, 0.0, 0.0), (1, 2, 0.0, 0.0), (1, 4, pytest.approx(1.0), 0.5)]
    assert run.segments[-1].end_h == pytest.approx(finish[1])


# -- the command, on the cost model ----------------------------------------------------------------------
JOBS = ("jobs.jobs=[{name: big, model: llama3_8b, global_batch_size: 128, tokens: 2.0e10, deadline_hours: 30},"
        "{name: small, model: llama3_8b, global_batch_size: 32, seq_length: 4096, tokens: 2.0e9, deadline_hours: 10},"
        "{name: later, model: llama3_8b, global_batch_size: 32, seq_length: 4096, tokens: 1.0e9, arrives_later: true}]")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("pack")
    code = main(["pack", "cluster.num_nodes=8", JOBS, "pack.node_counts=[1,2,4,8]", "pack.baseline_pipeline_sizes=[1,2]",
                 "pack.arrive=true", f"output.dir={out}"])
    assert code == 0
    return out


def test_pack_writes_assignments_baselines_and_a_plan_dir_per_job(packed):
    doc = yaml.safe_load((packed / "pack.yaml").read_text())
    assert doc["format"] == "megapipe-pack/1"
    nodes = {a["job"]: a["nodes"] for a in doc["assignments"]}
    assert set(nodes) == {"big", "small"} and sum(nodes.values()) <= 8
    names = [p["name"] for p in doc["policies"]]
    assert names[0] == "packed" and "one after another" in names and "even split" in names
    assert any(name.startswith("fixed PP") for name in names)
    packed_policy = doc["policies"][0]
    for policy in doc["policies"][1:]:
        if policy["name"] != "one after another":  # concurrent packings: the optimum at the start
            assert packed_policy["weighted_model_pflops_per_s"] >= policy["weighted_model_pflops_per_s"] * (1 - 1e-6)
    for assignment in doc["assignments"]:
        args = (packed / "jobs" / assignment["job"] / "megatron_args.txt").read_text()
        assert f"--tensor-model-parallel-size {assignment['tensor_model_parallel_size']}" in args
        assert f"--pipeline-model-parallel-size {assignment['pipeline_model_parallel_size']}" in args
        plan = yaml.safe_load((packed / "jobs" / assignment["job"] / "plan.yaml").read_text())
        assert plan["best"]["parallel"]["data_parallel_size"] * assignment["tensor_model_parallel_size"] * \
            assignment["pipeline_model_parallel_size"] * assignment["context_parallel_size"] == assignment["gpus"]
        for name in ("bridge_overrides.txt", "nemo2_overrides.txt", "nemo1_overrides.txt", "launch_megatron.sh",
                     "launch_slurm.sbatch"):
            assert (packed / "jobs" / assignment["job"] / name).stat().st_size > 0
        sbatch = packed / "jobs" / assignment["job"] / "launch_slurm.sbatch"
        subprocess.run(["bash", "-n", str(sbatch)], check=True)
        assert f"#SBATCH --nodes={assignment['nodes']}\n" in sbatch.read_text()
    assert (packed / "cluster.png").read_bytes()[:4] == b"\x89PNG"
    what_if = doc["what_if"]
    assert {a["job"] for a in what_if["assignments"]} == {"big", "small", "later"}
    assert sum(a["nodes"] for a in what_if["assignments"]) <= 8


def test_pack_output_is_reproducible(packed, tmp_path):
    code = main(["pack", "cluster.num_nodes=8", JOBS, "pack.node_counts=[1,2,4,8]", "pack.baseline_pipeline_sizes=[1,2]",
                 "pack.arrive=true", f"output.dir={tmp_path}"])
    assert code == 0
    assert (tmp_path / "pack.yaml").read_bytes() == (packed / "pack.yaml").read_bytes()
    assert (tmp_path / "cluster.png").read_bytes() == (packed / "cluster.png").read_bytes()


@pytest.mark.parametrize(("overrides", "message"), [
    (["jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64}, {name: a, model: llama3_8b, "
      "global_batch_size: 64}]"], "the name 'a' appears more than once"),
    (["jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64, gpu: b900}]"], "gpu='b900' is no GPU type"),
    (["jobs.jobs=[{name: a, model: llama9_1t, global_batch_size: 64}]"], "model='llama9_1t' is no hydra_conf/model"),
    (["jobs.jobs=[{name: a, model: llama3_405b, global_batch_size: 64}]", "cluster.num_nodes=1"],
     "job 'a' (llama3_405b"),
    (["pack.objective=makespan", "jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64}]"],
     "needs a token budget"),
    (["pack.objective=fastest"], "pack.objective='fastest'"),
    (["jobs.jobs=[{name: 'a b', model: llama3_8b, global_batch_size: 64}]"], "must be letters"),
])
def test_bad_input_gets_one_line_and_exit_2(overrides, message, capsys, tmp_path):
    assert main(["pack", *overrides, f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_users_settings_reach_every_job(tmp_path):
    """parallel.*, schedule=, train.* and search.* hold for every job, as they do for `plan`."""
    one = "jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64}, {name: b, model: llama3_8b, global_batch_size: 32}]"
    code = main(["pack", "cluster.num_nodes=4", one, "pack.node_counts=[1,2,4]", "pack.baseline_pipeline_sizes=[2]",
                 "parallel.tensor_model_parallel_size=2", "schedule=1f1b", "train.recompute_granularity=full",
                 "search.max_pipeline_model_parallel_size=2", f"output.dir={tmp_path}"])
    assert code == 0
    doc = yaml.safe_load((tmp_path / "pack.yaml").read_text())
    for assignment in doc["assignments"]:
        assert assignment["tensor_model_parallel_size"] == 2
        assert assignment["schedule"] == "1f1b" and assignment["virtual_pipeline_model_parallel_size"] in (None, 1)
        assert assignment["recompute_granularity"] == "full" and assignment["pipeline_model_parallel_size"] <= 2
        args = (tmp_path / "jobs" / assignment["job"] / "megatron_args.txt").read_text()
        assert "--recompute-granularity full" in args


def test_each_job_gets_its_own_fields_and_the_command_lines_for_the_rest():
    """A job's model, batch, sequence and precision are its own; a job that names no precision gets the command
    line's, whatever the job before it named (the jobs are set up one after another in one config)."""
    from omegaconf import OmegaConf

    from megapipe.config import compose, to_scenario
    from megapipe.config.jobs import jobs_of

    listed = ("jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64, precision: fp8},"
              "{name: b, model: llama3_70b, global_batch_size: 32, seq_length: 2048},"
              "{name: c, model: llama3_8b, global_batch_size: 16, seq_length: 4096, precision: bf16},"
              "{name: d, model: llama3_8b, global_batch_size: 64}]")
    for line in ("bf16", "fp8"):
        cfg = compose([listed, f"train.precision={line}"])
        before = OmegaConf.to_yaml(cfg)
        jobs = jobs_of(cfg, to_scenario(cfg, search=True).cluster)
        assert OmegaConf.to_yaml(cfg) == before  # the command line's config is left as it was
        assert [(job.model.name, job.train.global_batch_size, job.train.precision) for job in jobs] == [
            ("llama3_8b", 64, "fp8"), ("llama3_70b", 32, line), ("llama3_8b", 16, "bf16"), ("llama3_8b", 64, line)]
        assert [jobs[1].train.seq_length, jobs[2].train.seq_length] == [2048, 4096]


def test_a_job_that_cannot_take_a_pinned_setting_is_named(capsys, tmp_path):
    one = "jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64}, {name: odd, model: qwen3_30b_a3b, global_batch_size: 32}]"
    assert main(["pack", one, "parallel.tensor_model_parallel_size=8", f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "error: jobs.jobs[1] (odd):" in err and "tensor_model_parallel_size=8" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(("overrides", "nodes"), [
    ([], 64),  # lab_mix is written for 64 nodes: the default pack run packs on 64, as its description says
    (["cluster.num_nodes=8"], 8),
    (["jobs.jobs=[{name: a, model: llama3_8b, global_batch_size: 64}]"], 16),  # another list: the cluster's own
    (["cluster=mixed_h100_a100"], 16),
])
def test_the_job_list_sets_the_node_count_unless_the_command_line_does(overrides, nodes):
    from megapipe.config import compose
    from megapipe.config.jobs import with_jobs_nodes

    cfg, source = with_jobs_nodes(compose([*overrides, "hydra.job.name=pack"], return_hydra_config=True))
    assert cfg.cluster.num_nodes == nodes and (source is not None) == (nodes == 64)
    composed, none = with_jobs_nodes(compose(overrides))  # outside the CLI the command line is unknown
    assert none is None and composed.cluster.num_nodes == compose(overrides).cluster.num_nodes


def test_pack_yaml_shows_the_work(packed):
    """Every option the packing chose among (job, node group, node count, throughput, the plan), the policies' aims,
    and the timeline the picture draws."""
    doc = yaml.safe_load((packed / "pack.yaml").read_text())
    options = doc["options"]
    assert {entry["job"] for entry in options} == {"big", "small"}
    assert {"job", "gpu", "nodes", "tokens_per_s", "model_tflops_per_s", "plan"} <= set(options[0])
    assert options[0]["plan"].startswith("TP") and "mbs" in options[0]["plan"]
    taken = {entry["job"]: entry["nodes"] for entry in options if entry.get("packed")}
    assert taken == {a["job"]: a["nodes"] for a in doc["assignments"]}
    assert all(policy["aim"] for policy in doc["policies"])
    assert {segment["job"] for segment in doc["timeline"]} == {"big", "small"}
    assert (packed / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_no_gain_is_quoted_over_a_policy_that_cannot_place_a_job():
    from megapipe.pack.pack import Policy, gain

    ours = Policy(name="packed", aim="", options=(_option(0, 2, 1e6),), weighted_flops_per_s=2e15, utilisation=0.5,
                  makespan_h=1.0, deadlines_met=0, met_weight=0.0)
    broken = Policy(name="even split", aim="", options=(None,), weighted_flops_per_s=1e15, utilisation=0.2,
                    makespan_h=math.inf, deadlines_met=0, met_weight=0.0)
    assert gain(ours, broken, "throughput") is None


def test_the_even_split_names_the_job_it_cannot_place():
    from megapipe.config import compose, to_scenario
    from megapipe.pack.pack import _even_split

    cluster = to_scenario(compose(["cluster.num_nodes=4"]), search=True).cluster
    jobs = [_job("wide", tokens=1e9), _job("narrow", tokens=1e9)]
    options = [[_option(0, 4, 2e6)], [_option(0, 1, 1e6), _option(0, 2, 2e6)]]
    policy = _even_split(jobs, options, cluster, (4,), peak=1e18, restart_h=0.0)
    assert policy.options[0] is None and policy.note.startswith("wide fits in no even share of 2 nodes")


def test_the_answer_does_not_depend_on_the_processes_that_search():
    """The curves' searches run one batch per job shape through a process pool or the built-in map; with several
    processes, two per shape when there are too few shapes for them, else all but the heaviest shapes one search a
    batch (a process then keeps a shape's unit costs for its later batches). The packing, every baseline and the
    search count are the same."""
    import multiprocessing

    from megapipe.config import compose, to_scenario
    from megapipe.options import PackOptions
    from megapipe.pack import pack_jobs
    from megapipe.pack.curves import _PROCESS_COSTS
    from megapipe.records import JobSpec

    cluster = to_scenario(compose(["cluster.num_nodes=8"]), search=True).cluster
    small = compose(["model=llama3_8b"])
    model = to_scenario(small, search=True).model
    jobs = [JobSpec(name=f"job{i}", model=model, train=TrainSpec(global_batch_size=batch, seq_length=2048),
                    tokens=1e10, weight=1.0) for i, batch in enumerate((32, 64, 64, 16, 128))]
    options = PackOptions(node_counts=(1, 2, 4, 8), baseline_pipeline_sizes=(1, 2))
    alone = pack_jobs(jobs, cluster, options)
    assert not _PROCESS_COSTS  # nothing kept in this process once the curves are in
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pooled = pack_jobs(jobs, cluster, options, mapper=pool.imap)  # a batch per shape
        halved = pack_jobs(jobs, cluster, options, mapper=pool.imap, workers=3)  # two per shape: too few shapes
        single = pack_jobs(jobs, cluster, options, mapper=pool.imap, workers=2)  # the two lightest shapes search by search

    def summary(result):
        return [(policy.name, [(o.group, o.nodes, o.tokens_per_s) if o else None for o in policy.options],
                 policy.weighted_flops_per_s) for policy in (result.packed, *result.baselines)]

    assert summary(alone) == summary(pooled) == summary(halved) == summary(single)
    assert alone.searches == pooled.searches == halved.searches == single.searches


def test_pack_hands_over_its_packing_as_soon_as_it_is_decided_and_run():
    """``decided`` gets the jobs present and the packing at its decision, ``ran`` the packing run to the end and the
    packing for deadlines (where shown), each once and in that order; the answer is the same as without them."""
    from megapipe.config import compose, to_scenario
    from megapipe.options import PackOptions
    from megapipe.pack import pack_jobs
    from megapipe.records import JobSpec

    cluster = to_scenario(compose(["cluster.num_nodes=4"]), search=True).cluster
    model = to_scenario(compose(["model=llama3_8b"]), search=True).model
    jobs = [JobSpec(name=f"job{i}", model=model, train=TrainSpec(global_batch_size=batch, seq_length=2048),
                    tokens=1e10, weight=1.0, deadline_hours=hours)
            for i, (batch, hours) in enumerate(((32, 1.0), (64, 100.0)))]
    options = PackOptions(node_counts=(1, 2, 4), baseline_pipeline_sizes=(1, 2))
    calls = []
    result = pack_jobs(jobs, cluster, options, decided=lambda *args: calls.append(("decided", args)),
                       ran=lambda *args: calls.append(("ran", args)))
    assert [name for name, _ in calls] == ["decided", "ran"]
    present, packed = calls[0][1]
    assert present == result.jobs and packed.options == result.packed.options and not packed.segments
    assert calls[1][1][0] is result.packed and calls[1][1][1] is result.alternative
    assert result.alternative is not None  # job0 misses its hour: the packing for deadlines is shown
    plain = pack_jobs(jobs, cluster, options)
    assert [(p.name, p.weighted_flops_per_s, p.finish_h) for p in (plain.packed, plain.alternative, *plain.baselines)] \
        == [(p.name, p.weighted_flops_per_s, p.finish_h) for p in (result.packed, result.alternative, *result.baselines)]


def test_pack_runs_on_the_node_count_its_job_list_is_written_for(tmp_path, capsys):
    """The command line names no cluster size: the job list's num_nodes holds, and the console says where it came
    from (the default run said lab_mix's 64 x 8 H100 and packed the cluster's 16 nodes)."""
    conf = tmp_path / "conf" / "jobs"
    conf.mkdir(parents=True)
    (conf / "two.yaml").write_text(
        "defaults: [base_jobs, _self_]\nname: two\nnum_nodes: 2\njobs:\n"
        "  - {name: a, model: llama3_8b, global_batch_size: 64, tokens: 1.0e9}\n"
        "  - {name: b, model: llama3_8b, global_batch_size: 32, tokens: 1.0e9}\n")
    assert main(["pack", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "jobs=two", "pack.node_counts=[1,2]",
                 "output.pictures=false", f"output.dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs on 2 h100_80gb nodes (16 GPUs" in out and "the node count two is written for" in out
    assert main(["pack", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "jobs=two", "cluster.num_nodes=4",
                 "pack.node_counts=[1,2]", "output.pictures=false", f"output.dir={tmp_path / 'four'}"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs on 4 h100_80gb nodes (32 GPUs" in out and "written for" not in out
