"""A separate process receiving a training job's weight stream (issue 24: "stream into a separate
process's transformers model"), as an inference engine outside the job would.

    python stream_receiver.py HF_DIR REF.pt NRANKS PORT_FILE OUT.json

Listens on 127.0.0.1 (port written to PORT_FILE), takes one connection per training rank and
reads, per tensor, a JSON header (name, dtype, shape) then its raw bytes — no pickle — until
`done`. The tensors (the checkpoint's names and layout, `mode="stage"`: one receiving rank per
stage, expert-parallel ones included) are written beside HF_DIR's config and loaded with
transformers' `from_pretrained`, which converts them as it converts any checkpoint; OUT.json
gets the tensor count and max |logits - REF's transformers logits| for REF's input ids.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
from multiprocessing.connection import Listener
from pathlib import Path

import torch

AUTHKEY = b"mbr-stream-test"


def _read(conn, got: dict[str, torch.Tensor]) -> None:
    while (head := conn.recv_bytes()) != b"done":
        meta = json.loads(head)
        raw = bytearray(conn.recv_bytes())
        got[meta["name"]] = (
            torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, meta["dtype"])).reshape(meta["shape"])
        )
    conn.close()


def main() -> None:
    hf, ref, nranks, port_file, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    got: dict[str, torch.Tensor] = {}
    with Listener(("127.0.0.1", 0), authkey=AUTHKEY) as listener:
        port_file.write_text(str(listener.address[1]))
        conns = [listener.accept() for _ in range(nranks)]  # every rank connects before streaming
    readers = [threading.Thread(target=_read, args=(c, got)) for c in conns]  # the ranks send at once
    for r in readers:
        r.start()
    for r in readers:
        r.join()

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(hf / "config.json", tmp)
        save_file(got, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        refs = torch.load(ref)
        with torch.no_grad():
            logits = model(refs["input_ids"]).logits
    Path(out).write_text(json.dumps({"tensors": len(got), "max_abs": float((logits - refs["logits"]).abs().max())}))


if __name__ == "__main__":
    main()
