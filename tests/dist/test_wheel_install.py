"""The built wheel, installed (not editable) into a fresh venv, used from outside the repository.

Slow (a wheel build, a venv, tiny conversions and a 2-process training run: about a minute),
hence the `dist` mark. To stay fast and offline the venv reuses the already-installed
dependencies: after `pip install --no-deps` of the wheel, a .pth file appends the running
interpreter's site-packages to the venv's path. That directory's own .pth files (the
editable install of this checkout) are not processed for a path added that way, and the
venv's site-packages comes first, so `megatron_bridge` can only come from the wheel; the
subprocesses run with no PYTHONPATH, a PATH of the venv and the system only, and a working
directory outside the repository, and the test asserts where the package was imported from.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["pyproject.toml", "README.md", "megatron_bridge", "conf", "recipes"]

RECIPE = """\
defaults: [mbr_schema, {model: tiny_llama}, {parallel: default}, {zero: none}, {cluster: my_cluster},
           {optimizer: adam}, {data: synthetic}, {train: default}, {checkpoint: default}, _self_]
parallel: {tp: 2}
train: {seq_length: 32, micro_batch_size: 1, global_batch_size: 4, steps: 3, log_interval: 1}
optimizer: {warmup_steps: 1}
"""
CLUSTER = "name: my_cluster\nnodes: 1\ngpus_per_node: 2\nbackend: gloo\ngpu_memory_gb: 8\n"


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: the build writes build/ and *.egg-info next to pyproject
    src.mkdir()
    for name in SHIPPED:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(p, src / name)
    py = sys.executable
    run([py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src)])
    (wheel,) = (tmp / "dist").glob("mbr_bridge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ["megatron_bridge/_bundled/recipes/tiny_llama.yaml", "megatron_bridge/_bundled/cluster/cpu_local.yaml"]:
        assert f in names, f
    n_yaml = sum(1 for p in [*ROOT.glob("conf/*/*.yaml"), *ROOT.glob("recipes/*.yaml")])
    assert sum(n.endswith(".yaml") for n in names) == n_yaml

    env_dir = tmp / "venv"
    run([py, "-m", "venv", "--without-pip", str(env_dir)])
    vpy = env_dir / "bin" / "python"
    run([py, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index", "-q", str(wheel)])
    purelib = subprocess.run(
        [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(purelib, "_shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture()
def user(venv, tmp_path):
    """(run-in-venv function, the user's config dir); cwd is a fresh directory outside the repo."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MBR_CONFIG_PATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv}/bin:/usr/bin:/bin", OMP_NUM_THREADS="1", WANDB_MODE="offline")
    cfg = tmp_path / "my-configs"
    (cfg / "recipes").mkdir(parents=True)
    (cfg / "cluster").mkdir()
    (cfg / "recipes" / "mine.yaml").write_text(RECIPE)
    (cfg / "cluster" / "my_cluster.yaml").write_text(CLUSTER)
    (cfg / "my.yaml").write_text(RECIPE.replace("{cluster: my_cluster}", "{cluster: cpu_local}"))
    work = tmp_path / "work"
    work.mkdir()
    assert ROOT not in work.parents

    def mbr(*args, check=True):
        r = subprocess.run(
            [f"{venv}/bin/mbr", *map(str, args)], capture_output=True, text=True, timeout=600, cwd=work, env=env
        )
        if check:
            assert r.returncode == 0, f"mbr {args}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    def python(code):
        return run([f"{venv}/bin/python", "-c", code], cwd=work, env=env).stdout

    return mbr, python, cfg, work


def test_installed_package_comes_from_the_wheel(user, venv):
    _, python, _, _ = user
    where = python(
        "import megatron_bridge, megatron_bridge._bundled as b; print(megatron_bridge.__file__); print(b.__file__)"
    )
    for line in where.split():
        assert Path(line).is_relative_to(venv) and not Path(line).is_relative_to(ROOT), where


def test_commands_from_outside_the_repository(user, venv):
    mbr, python, cfg, work = user
    r = mbr("check", "recipe=tiny_llama")
    assert "layout OK: tp2·pp2" in r.stdout
    r = mbr("check", f"recipe={cfg}/my.yaml")
    assert "(cpu_local)" in r.stdout and "layout OK: tp2·pp1" in r.stdout
    r = mbr("check", "recipe=mine", "--config-dir", cfg)
    assert "(my_cluster)" in r.stdout and "× 2" in r.stdout
    r = mbr("recipes", "--config-dir", cfg)
    assert f"{cfg}/recipes/mine.yaml" in r.stdout and "built-in" in r.stdout
    r = mbr("check", "recipe=nope", check=False)
    assert r.returncode == 2 and "unknown recipe 'nope'" in r.stderr and "Traceback" not in r.stderr
    r = mbr(
        "plan",
        "model=llama3_8b",
        "cluster=dgx_h100",
        "cluster.nodes=2",
        "train.seq_length=4096",
        "train.global_batch_size=128",
    )
    assert "CHOSEN" in r.stdout

    # convert a tiny HF model, then train from it on 2 processes under torchrun with the user's recipe
    python("from megatron_bridge.runtime.tiny import make_tiny; make_tiny('llama', 'hf')")
    r = mbr("convert", "src=hf", "dst=converted")
    assert "converted" in r.stdout and (work / "converted" / "config.json").is_file()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = mbr(
        "launch",
        "recipe=mine",
        "--config-dir",
        cfg,
        f"cluster.master_port={port}",
        "model.hf_path=converted",
        "train.init_from=converted",
    )
    (run_dir,) = (work / "runs" / "mine").iterdir()  # the resolved config every rank trained with
    resolved = (run_dir / "config.yaml").read_text()
    assert "name: my_cluster" in resolved and "tp: 2" in resolved
    assert re.search(r"step +3/3 \|", r.stdout), r.stdout[-2000:]
