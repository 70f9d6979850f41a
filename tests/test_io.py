"""megapipe.files, profile and plan files: atomic writes with the umask's mode, the fast YAML emitter writes the pure one's bytes, readers' errors."""

from __future__ import annotations

import os
import stat

import pytest
import yaml

from megapipe import files, plandir
from megapipe.profile import format as profile_file
from megapipe.errors import ConfigError, ProfileError
from megapipe.records import LayerCost, LayerKind, Profile


def _profile() -> Profile:
    unit = dict(fwd_ms=1.25, bwd_ms=2.5, wgrad_ms=1.0, static_bytes=3.0e9, act_bytes=1.5e8, param_count=1.0e8)
    layers = [LayerCost(name="embedding", kind=LayerKind.embedding, **unit)]
    layers += [LayerCost(name=f"decoder.{i}", kind=LayerKind.decoder, **unit) for i in range(3)]
    layers += [LayerCost(name="output", kind=LayerKind.loss, **unit)]
    return Profile(layers=tuple(layers), device="h100_80gb", meta=(("source", "test"), ("note", "a: b, 'c'")))


def test_atomic_write_respects_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        files.atomic_write_text(tmp_path / "a.txt", "x\n")
        files.atomic_write_bytes(tmp_path / "b.png", b"\x89PNG")
    finally:
        os.umask(old)
    for name in ("a.txt", "b.png"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_fast_emitter_writes_the_pure_emitters_bytes(tmp_path):
    """plan.yaml and profile.yaml keep the bytes PyYAML's pure-Python emitter gives."""
    from megapipe.commands.plan import prepare
    from megapipe.config import compose
    from megapipe.plan.document import plan_document
    from megapipe.plan.search import search
    from megapipe.profile.format import profile_to_dict

    job = prepare(compose(["model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8"]))
    scenario = job.scenario
    result = search(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=scenario.fixed,
                    options=job.search)
    document = plan_document(result=result, model=scenario.model, cluster=scenario.cluster, inputs=job.inputs)
    pure = yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=120)
    assert files.dump_yaml(document) == pure
    profile = profile_to_dict(_profile())
    assert files.dump_yaml(profile, flow=None, width=200) == yaml.safe_dump(profile, sort_keys=False,
                                                                        default_flow_style=None, width=200)


def test_profile_round_trip_and_errors(tmp_path):
    path = tmp_path / "p.yaml"
    profile_file.save_profile(_profile(), path)
    assert profile_file.load_profile(path) == _profile()
    with pytest.raises(ProfileError, match="cannot read profile"):
        profile_file.load_profile(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        profile_file.load_profile(tmp_path / "bad.yaml")


def test_read_plan_names_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        plandir.read_plan(tmp_path)
    (tmp_path / "plan.yaml").write_text("format: megapipe-profile/1\n")
    with pytest.raises(ConfigError, match="megapipe-plan/1"):
        plandir.read_plan(tmp_path)
    (tmp_path / "plan.yaml").write_text("format: megapipe-plan/1\nbest: {}\n")
    assert plandir.read_plan(tmp_path / "plan.yaml")["best"] == {}


def test_the_readmes_python_example_runs(tmp_path, capsys):
    """README's Python API block, on a profile.yaml a plan dir holds (it imported megapipe.io, which is gone)."""
    import pathlib
    import re

    from megapipe.cli import main

    assert main(["plan", "model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8", "output.pictures=false",
                 "output.format=json", f"output.dir={tmp_path}"]) == 0
    capsys.readouterr()
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"Python API:\n\n```python\n(.*?)```", readme, re.S).group(1)
    block = block.replace('"profile.yaml"', repr(str(tmp_path / "profile.yaml"))).replace("* 8,", "* 2,")
    exec(compile(block, "README.md", "exec"), {})
