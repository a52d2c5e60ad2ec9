"""`mbr data` as a user runs it: the demo, preprocessing, and clear errors before heavy work."""

import json
import subprocess
import sys

import pytest

from megatron_bridge.commands.data import main
from megatron_bridge.errors import UserError


def mbr_data(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", "data", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "demo"
    assert main(["demo=true", f"output_dir={out}", "max_bytes=100000", "vocab_size=320"]) == 0
    return out


def test_demo_writes_a_complete_dataset_and_prints_the_overrides(demo_dir, capsys):
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == [
        "corpus.jsonl",
        "stdlib_text_document.bin",
        "stdlib_text_document.idx",
        "stdlib_text_document.meta.json",
        "tokenizer",
    ]
    meta = json.loads((demo_dir / "stdlib_text_document.meta.json").read_text())
    assert meta["vocab_size"] == 320 and meta["tokenizer"] == str(demo_dir / "tokenizer")
    assert not [p for p in demo_dir.parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_preprocess_command(demo_dir, tmp_path, capsys):
    rc = main(
        [f"input={demo_dir / 'corpus.jsonl'}", f"output={tmp_path / 'ds'}", f"tokenizer={demo_dir / 'tokenizer'}"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and (tmp_path / "ds.bin").is_file() and (tmp_path / "ds.idx").is_file()
    assert f"data=indexed data.paths=[{tmp_path / 'ds'}] data.tokenizer={demo_dir / 'tokenizer'}" in out
    # data.tokenizer is the fallback for tokenizer=
    assert (
        main(
            [
                f"input={demo_dir / 'corpus.jsonl'}",
                f"output={tmp_path / 'ds2'}",
                f"data.tokenizer={demo_dir / 'tokenizer'}",
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["output=OUT/x", "tokenizer=TOK"], "no input given"),
        (["input=OUT/missing.jsonl", "output=OUT/x", "tokenizer=TOK"], "input OUT/missing.jsonl does not exist"),
        (["input=CORPUS", "output=OUT/x"], "no tokenizer given"),
        (["input=CORPUS", "output=OUT/x", "tokenizer=OUT/notok"], "tokenizer directory OUT/notok does not exist"),
        (["input=CORPUS", "tokenizer=TOK"], "no output given"),
        (["input=CORPUS", "output=EXISTING", "tokenizer=TOK"], "indexed dataset already exists"),
        (["demo=true"], "demo=true needs output_dir=DIR"),
        (["demo=true", "output_dir=DEMO"], "output_dir already exists"),
        (
            ["demo=true", "output_dir=OUT/d", "vocab_size=4096"],
            "vocab_size=4096 is larger than the recipe's model.vocab_size=512",
        ),
        (["demo=true", "output_dir=OUT/d", "input=CORPUS"], "drop input="),
        (["input=CORPUS", "output=OUT/x", "tokenizer=TOK", "inptu=x"], "Key 'inptu' not in 'DataCommandConfig'"),
    ],
)
def test_user_errors_exit_2_without_traceback_and_write_nothing(demo_dir, tmp_path, args, needle):
    subst = {
        "OUT": str(tmp_path),
        "TOK": str(demo_dir / "tokenizer"),
        "CORPUS": str(demo_dir / "corpus.jsonl"),
        "EXISTING": str(demo_dir / "stdlib_text_document"),
        "DEMO": str(demo_dir),
    }

    def fill(s):
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    before = sorted(p.name for p in demo_dir.iterdir())
    with pytest.raises(UserError) as e:
        main([fill(a) for a in args])
    assert fill(needle) in str(e.value)
    assert list(tmp_path.iterdir()) == [] and sorted(p.name for p in demo_dir.iterdir()) == before


def test_cli_exit_code_and_message(tmp_path):
    r = mbr_data(f"input={tmp_path}/nope.jsonl", f"output={tmp_path}/x", f"tokenizer={tmp_path}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: input ") and "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
    r = subprocess.run(
        [sys.executable, "-m", "megatron_bridge.data", "demo=true"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "needs output_dir" in r.stderr


def test_cfg_job_shows_the_command_keys():
    r = mbr_data("--cfg", "job", "input=a.jsonl")
    assert r.returncode == 0, r.stderr
    assert "input: a.jsonl" in r.stdout and "demo: false" in r.stdout and "data:\n  kind: synthetic" in r.stdout
