"""Preference rows → (prompt ids, chosen ids, rejected ids), tokenized exactly as TRL 1.16's
`DPOTrainer` does (trl/trainer/dpo_trainer.py `_prepare_dataset`), so a pair trains on the tokens
TRL would train on. Three row forms:

* strings `{"prompt", "chosen", "rejected"}`: the tokenizer's eos text is appended to a completion
  that does not end with it; prompt, prompt+chosen and prompt+rejected are tokenized as text with
  the tokenizer's own special tokens (a bos where it adds one), and the completion starts where
  the tokenized prompt and prompt+completion stop agreeing (TRL's `common_prefix_length`).
* conversations: `chosen`/`rejected` message lists, with an optional `prompt` list. Without one
  the prompt is their shared leading messages (TRL's `extract_prompt`). Rendered with the chat
  template (the prompt with the generation prompt), completions found the same way.
* pre-tokenized `{"prompt_ids", "chosen_ids", "rejected_ids"}`: used as given, nothing added.

A string row without `prompt` has its prompt extracted the same way (the shared leading text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from megatron_bridge.data.chat import _messages, has_content
from megatron_bridge.data.token_rows import check_ids
from megatron_bridge.errors import UserError

TEXT_KEYS = ("prompt", "chosen", "rejected")
TOKEN_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
EXAMPLE = '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}'


class Pair(NamedTuple):
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def extract_prompt(chosen: Sequence, rejected: Sequence) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected): TRL's `extract_prompt`, the longest shared prefix (of
    messages, or characters: a space before the first difference stays with the completions)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _split(prompt_ids: list[int], full_chosen: list[int], full_rejected: list[int]) -> Pair:
    n = min(common_prefix_length(prompt_ids, full_chosen), common_prefix_length(prompt_ids, full_rejected))
    return Pair(prompt_ids[:n], full_chosen[n:], full_rejected[n:])


class PairEncoder:
    """Tokenizes preference rows (module docstring). `tok` None: only pre-tokenized rows."""

    def __init__(self, tok: Any, vocab: int, template: str | None = None, source: str = ""):
        self.tok, self.vocab, self.template, self.source = tok, vocab, template, source

    def encode(self, rec: dict[str, Any], where: str) -> Pair:
        if any(k in rec for k in TOKEN_KEYS):
            pair = self._ids(rec, where)
        else:
            missing = [k for k in ("chosen", "rejected") if k not in rec]
            if missing:
                raise UserError(
                    f"{where}: no {' or '.join(map(repr, missing))} (found: {', '.join(map(repr, rec)) or 'nothing'}); "
                    f"a preference row holds a prompt and two completions, e.g. {EXAMPLE} (or message lists, or "
                    "prompt_ids/chosen_ids/rejected_ids)"
                )
            if self.tok is None:
                raise UserError(
                    f"{where}: a text row needs tokenizer=DIR to tokenize it (vocab_size= alone reads pre-tokenized "
                    "rows only: prompt_ids, chosen_ids, rejected_ids)"
                )
            conv = isinstance(rec["chosen"], list)
            pair = self._conversation(rec, where) if conv else self._strings(rec, where)
            for key, ids in (("chosen", pair.chosen), ("rejected", pair.rejected)):
                if not ids:
                    raise UserError(f"{where}: {key!r} renders to no tokens after the prompt; give it some content")
        if pair.chosen == pair.rejected:
            raise UserError(
                f"{where}: 'chosen' and 'rejected' are the same tokens, so the pair prefers nothing (its DPO loss "
                "has no gradient); fix the row or leave it out"
            )
        return pair

    def _ids(self, rec: dict[str, Any], where: str) -> Pair:
        missing = [k for k in TOKEN_KEYS if k not in rec]
        if missing:
            raise UserError(
                f"{where}: no {' or '.join(map(repr, missing))}: a pre-tokenized preference row holds all of "
                f'{", ".join(TOKEN_KEYS)}, e.g. {{"prompt_ids": [5, 6], "chosen_ids": [7, 2], "rejected_ids": [8, 2]}}'
            )
        p = check_ids(rec["prompt_ids"], where, "prompt_ids", self.vocab, allow_empty=True)
        return Pair(p, *(check_ids(rec[k], where, k, self.vocab) for k in TOKEN_KEYS[1:]))

    def _strings(self, rec: dict[str, Any], where: str) -> Pair:
        for k in TEXT_KEYS:
            if k in rec and not isinstance(rec[k], str):
                raise UserError(
                    f"{where}: {k!r} is a {type(rec[k]).__name__}; in a text row prompt, chosen and rejected are "
                    "strings (or all message lists, for conversations)"
                )
        for k in ("chosen", "rejected"):
            if not rec[k].strip():
                raise UserError(f"{where}: {k!r} is empty; a preference pair needs two non-empty completions")
        if "prompt" in rec:
            prompt, chosen, rejected = rec["prompt"], rec["chosen"], rec["rejected"]
        else:
            prompt, chosen, rejected = extract_prompt(rec["chosen"], rec["rejected"])
        eos = self.tok.eos_token
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))

        def ids(text: str) -> list[int]:
            return list(self.tok(text=text, verbose=False)["input_ids"])

        return _split(ids(prompt), ids(prompt + chosen), ids(prompt + rejected))

    def _conversation(self, rec: dict[str, Any], where: str) -> Pair:
        msgs = {}
        for k in TEXT_KEYS:
            if k not in rec:
                continue
            if not isinstance(rec[k], list):
                raise UserError(
                    f"{where}: {k!r} is a {type(rec[k]).__name__} but 'chosen' is a message list; give the prompt "
                    "as a message list too, or leave it out (the messages chosen and rejected share are the prompt)"
                )
            msgs[k] = _messages({"messages": rec[k]}, f"{where}: {k!r}")
            if any(not isinstance(m["content"], str) for m in msgs[k]):
                raise UserError(f"{where}: {k!r} has content parts; preference conversations are text (string content)")
        for k in ("chosen", "rejected"):
            if not msgs[k] or not has_content(msgs[k]):
                raise UserError(f"{where}: {k!r} is empty; a preference pair needs two non-empty completions")
        if "prompt" in msgs:
            prompt, chosen, rejected = msgs["prompt"], msgs["chosen"], msgs["rejected"]
        else:
            prompt, chosen, rejected = extract_prompt(msgs["chosen"], msgs["rejected"])
        for k, c in (("chosen", chosen), ("rejected", rejected)):
            if not c:
                raise UserError(
                    f"{where}: {k!r} has no message after the prompt (the messages chosen and rejected share); "
                    "give each a completion"
                )
        return _split(
            self._render(prompt, where, True),
            self._render(prompt + chosen, where),
            self._render(prompt + rejected, where),
        )

    def _render(self, msgs: list[dict[str, Any]], where: str, generation_prompt: bool = False) -> list[int]:
        try:
            enc = self.tok.apply_chat_template(
                msgs,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # jinja raises whatever the template does (raise_exception(...))
            raise UserError(f"{where}: the chat template of {self.source} failed on this conversation: {e}") from e
        return list(enc["input_ids"])
