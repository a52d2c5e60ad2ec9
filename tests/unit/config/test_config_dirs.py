"""Users' own configs: recipe=PATH.yaml, --config-dir, $MBR_CONFIG_PATH, `mbr recipes`, `mbr init`,
and the one CLI vocabulary (src= / model.hf_path=)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge.config import search
from megatron_bridge.config.compose import compose, list_group, parse_args
from megatron_bridge.errors import UserError

ROOT = Path(__file__).resolve().parents[3]

RECIPE = """\
defaults:
  - mbr_schema
  - model: tiny_llama
  - parallel: default
  - zero: none
  - cluster: {cluster}
  - optimizer: adam
  - data: synthetic
  - train: default
  - checkpoint: default
  - _self_
parallel:
  tp: 2
{extra}"""

CLUSTER = "name: my_cluster\nnodes: 1\ngpus_per_node: 2\nbackend: gloo\n{extra}"


def user_dir(tmp_path, *, cluster="my_cluster", recipe_extra="", cluster_extra="", name="mine"):
    d = tmp_path / "cfg"
    (d / "recipes").mkdir(parents=True)
    (d / "cluster").mkdir()
    (d / "recipes" / f"{name}.yaml").write_text(RECIPE.format(cluster=cluster, extra=recipe_extra))
    (d / "cluster" / "my_cluster.yaml").write_text(CLUSTER.format(extra=cluster_extra))
    return d


def mbr(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.fixture(autouse=True)
def _no_env_dirs(monkeypatch):
    monkeypatch.delenv(search.ENV, raising=False)


def test_bundled_package_mirrors_conf_and_recipes():
    """Every schema group (and recipes/) is reachable through megatron_bridge._bundled, and is
    the repository's own folder, not a copy."""
    b = search.builtin()
    assert b.url == "pkg://megatron_bridge._bundled"
    for g in search.groups():
        assert (b.root / g).resolve() == (ROOT / "conf" / g).resolve(), g
    assert b.recipes.resolve() == (ROOT / "recipes").resolve()
    assert {p.name for p in (ROOT / "conf").iterdir()} == set(search.groups())


@pytest.mark.parametrize("how", ["path", "config-dir", "env"])
def test_user_recipe_and_group_option(tmp_path, monkeypatch, how):
    d = user_dir(tmp_path)
    argv = {
        "path": [f"recipe={d}/recipes/mine.yaml"],
        "config-dir": ["recipe=mine", "--config-dir", str(d)],
        "env": ["recipe=mine"],
    }[how]
    if how == "env":
        monkeypatch.setenv(search.ENV, f"{os.pathsep}{d}")  # empty entries are skipped
    cfg, _ = compose(argv)
    assert cfg.cluster.name == "my_cluster" and cfg.cluster.gpus_per_node == 2 and cfg.parallel.tp == 2


def test_recipe_file_next_to_group_folders(tmp_path):
    """recipe=DIR/my.yaml: DIR's own group folders are on the search path."""
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "my_cluster.yaml").write_text(CLUSTER.format(extra=""))
    (tmp_path / "my.yaml").write_text(RECIPE.format(cluster="my_cluster", extra=""))
    cfg, _ = compose([f"recipe={tmp_path}/my.yaml"])
    assert cfg.cluster.name == "my_cluster"


def test_user_option_overrides_builtin_and_first_dir_wins(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, gpus in [(a, 3), (b, 5)]:
        (d / "cluster").mkdir(parents=True)
        (d / "cluster" / "cpu_local.yaml").write_text(
            f"name: cpu_local\nnodes: 1\ngpus_per_node: {gpus}\nbackend: gloo\n"
        )
    cfg, _ = compose(["recipe=tiny_llama", "--config-dir", str(a), f"--config-dir={b}", "parallel.pp=1"])
    assert cfg.cluster.gpus_per_node == 3
    cfg, _ = compose(["recipe=tiny_llama", "--config-dir", str(b), "--config-dir", str(a), "parallel.pp=1"])
    assert cfg.cluster.gpus_per_node == 5
    assert "cpu_local" in list_group("cluster", parse_args(["--config-dir", str(a)]).sources())


def test_env_dirs_come_after_config_dir_flags(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, gpus in [(a, 3), (b, 5)]:
        (d / "cluster").mkdir(parents=True)
        (d / "cluster" / "cpu_local.yaml").write_text(
            f"name: cpu_local\nnodes: 1\ngpus_per_node: {gpus}\nbackend: gloo\n"
        )
    monkeypatch.setenv(search.ENV, str(b))
    cfg, _ = compose(["recipe=tiny_llama", "--config-dir", str(a), "parallel.pp=1"])
    assert cfg.cluster.gpus_per_node == 3
    cfg, _ = compose(["recipe=tiny_llama", "parallel.pp=1"])
    assert cfg.cluster.gpus_per_node == 5


def test_recipes_lists_sources_and_marks_overrides(tmp_path):
    d = user_dir(tmp_path)
    (d / "model").mkdir()
    (d / "model" / "tiny_llama.yaml").write_text((ROOT / "conf/model/tiny_llama.yaml").read_text())
    r = mbr("recipes", "--config-dir", str(d))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    line = {ln.split()[0]: ln for ln in lines if ln.startswith("  ") and not ln.strip()[0].isdigit()}
    assert f"{d}/recipes/mine.yaml" in line["mine"] and "overrides" not in line["mine"]
    assert line["tiny_mixtral"].split()[1:] == ["built-in"]
    assert f"{d}/model/tiny_llama.yaml" in line["tiny_llama"] and "overrides built-in" in line["tiny_llama"]
    assert f"{d}/cluster/my_cluster.yaml" in line["my_cluster"]


def test_init_writes_a_working_starter_and_never_overwrites(tmp_path):
    d = tmp_path / "mine"
    r = mbr("init", str(d))
    assert r.returncode == 0, r.stderr
    assert (d / "recipes" / "my_recipe.yaml").read_text().startswith("#")
    r = mbr("check", "recipe=my_recipe", "--config-dir", str(d))
    assert r.returncode == 0, r.stderr
    assert "(my_cluster)" in r.stdout and "layout OK: tp2" in r.stdout
    before = (d / "cluster" / "my_cluster.yaml").read_text()
    (d / "recipes" / "my_recipe.yaml").unlink()
    r = mbr("init", str(d))
    assert r.returncode == 2 and "does not overwrite" in r.stderr
    assert not (d / "recipes" / "my_recipe.yaml").exists()  # nothing half-written
    assert (d / "cluster" / "my_cluster.yaml").read_text() == before


@pytest.mark.parametrize(
    "kw,where,needle",
    [
        ({"recipe_extra": "train:\n  stepz: 3\n"}, "recipes/mine.yaml", "Key 'stepz' not in 'TrainConfig'"),
        ({"cluster": "their_cluster"}, "recipes/mine.yaml", "Could not find 'cluster/their_cluster'"),
        ({"cluster_extra": "gpus: 8\n"}, "cluster/my_cluster.yaml", "Key 'gpus' not in 'ClusterConfig'"),
        ({"cluster_extra": "nodes: 2\n"}, "cluster/my_cluster.yaml", "found duplicate key nodes"),
    ],
)
def test_bad_user_config_is_one_paragraph_naming_the_file(tmp_path, kw, where, needle):
    d = user_dir(tmp_path, **kw)
    r = mbr("check", "recipe=mine", "--config-dir", str(d))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and str(d / where) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_bad_values_in_user_options_are_schema_errors(tmp_path):
    d = user_dir(tmp_path, cluster_extra="peak_tflops: lots\n")
    r = mbr("check", "recipe=mine", "--config-dir", str(d))
    assert r.returncode == 2 and "could not be converted" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["recipe=/nonexistent/my.yaml"], "recipe file /nonexistent/my.yaml does not exist"),
        (["recipe=my.yml"], "recipe files end in .yaml"),
        (["--config-dir", "/nonexistent/cfg"], "config dir /nonexistent/cfg (from --config-dir) is not a directory"),
        (["--config-dir"], "--config-dir needs a directory"),
        (["recipe=mine"], "unknown recipe 'mine'"),
    ],
)
def test_search_path_refusals(argv, needle):
    with pytest.raises(UserError, match=None) as e:
        compose(argv)
    assert needle in str(e.value)


def test_config_dir_without_configs_is_refused(tmp_path):
    (tmp_path / "clusters").mkdir()  # a typo'd group folder: nothing usable
    with pytest.raises(UserError) as e:
        compose(["--config-dir", str(tmp_path)])
    assert "holds neither recipes/ nor any group folder" in str(e.value)


def test_relative_paths_resolve_from_the_working_directory(tmp_path):
    user_dir(tmp_path)
    r = mbr("check", "recipe=cfg/recipes/mine.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = mbr("check", "recipe=mine", "--config-dir", "cfg", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_launch_hands_every_rank_the_same_files(tmp_path, monkeypatch):
    """Ranks get the recipe file's absolute path and every user dir (flags and $MBR_CONFIG_PATH)
    as explicit --config-dir, so they need neither the launcher's cwd nor its environment."""
    from megatron_bridge.commands.launch import job_args

    d = user_dir(tmp_path)
    e = tmp_path / "shared"
    (e / "model").mkdir(parents=True)
    monkeypatch.setenv(search.ENV, str(e))
    monkeypatch.chdir(tmp_path)
    args = parse_args(["recipe=cfg/recipes/mine.yaml", "--config-dir", "cfg", "parallel.tp=1", "launcher=slurm"])
    assert job_args(args) == [
        f"recipe={d}/recipes/mine.yaml",
        "parallel.tp=1",
        f"--config-dir={e}",
    ]  # cfg/ is the recipe file's own dir (deduplicated); launch-only keys dropped
    args = parse_args(["recipe=mine", "--config-dir", "cfg", "k8s.image=x"])
    assert job_args(args) == ["recipe=mine", f"--config-dir={d}", f"--config-dir={e}"]


# One CLI vocabulary: an HF model directory a model is built from is model.hf_path=; src= means
# the same where a command has no src of its own; `mbr convert`'s input is named either way.


def test_src_is_model_hf_path_for_model_commands(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,'
        ' "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256}'
    )
    a, _ = compose([f"src={tmp_path}"])
    b, _ = compose([f"model.hf_path={tmp_path}"])
    assert a == b and a.model.hf_path == str(tmp_path) and a.model.num_query_groups == 2
    with pytest.raises(UserError, match="name the same thing"):
        compose([f"src={tmp_path}", "model.hf_path=/elsewhere"])
    c, _ = compose([f"src={tmp_path}", f"model.hf_path={tmp_path}"])
    assert c == a


def test_model_hf_path_is_src_for_convert():
    from megatron_bridge.convert.pipeline.schemas import ConvertConfig, ExportConfig

    a, _ = compose(["model.hf_path=/some/hf", "dst=/out"], schema=ConvertConfig)
    assert a.src == "/some/hf" and a.model.hf_path is None
    b, _ = compose(["src=/some/ckpt", "dst=/out"], schema=ExportConfig)
    assert b.src == "/some/ckpt" and b.model.hf_path is None  # export's src is its own field
