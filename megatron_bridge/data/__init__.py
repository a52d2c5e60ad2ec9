"""The data pipeline: text → HF tokenizer → megatron-core indexed dataset → GPTDataset → batches.

- `corpus`: a local corpus from the Python standard library's sources, and `train_tokenizer`
  (byte-level BPE with `tokenizers`, saved as a Hugging Face tokenizer directory);
- `tokenizer`: load a local HF tokenizer with clear errors, `check_vocab` against a model;
- `preprocess`: jsonl/txt → token ids (+eos per document) → `.bin`/`.idx` (atomic writes);
- `chat`: conversations → chat template → assistant character spans → per-token loss mask;
- `chat_dataset`: the chat dataset on disk (tokens + aligned loss mask): `preprocess_chat`
  writes it, `ChatDataset` reads conversations back by index, `ImageChatDataset` with their images;
- `chat_writer`: `ChatWriter`, the chat dataset's files and meta from rows of ids and a loss mask;
- `token_rows`: pre-tokenized rows (`{"input_ids", "labels"}` chats, id checks, any input format);
- `preference`, `preference_rows`: DPO pairs (`mbr data mode=preference`): rows tokenized as TRL's
  DPOTrainer does → PREFIX.chosen + PREFIX.rejected + PREFIX.preference.json, `PreferencePairs`;
- `images`, `chat_images`: image chats: image parts and columns, Pillow decoding and limits, the
  processor's placeholder expansion, PREFIX.images.jsonl, and `load_images` (pixels at training time);
- `loader`: the entry points `build_datasets` (megatron-core `BlendedMegatronDatasetBuilder` +
  `GPTDatasetConfig`, or a seeded synthetic dataset), `make_iterator`, `build_data_iterators`;
- `indexed`: `data.paths`/`data.split` parsing and `check_indexed_data` (data vs tokenizer vs
  model, non-empty splits), run before megatron-core is imported;
- `synthetic`: `SyntheticGPTDataset`, seeded random tokens in GPTDataset's sample layout;
- `batching`: a DP-sharded, deterministic, resumable micro-batch iterator (`DataIterator`,
  `PretrainingSampler`, `collate`) and megatron's load-balanced context-parallel slicing;
- `helpers`: megatron-core's C++ index helpers (prebuilt, or compiled once and cached);
- `demo`: corpus + tokenizer + indexed dataset in one directory (`mbr data demo=true`), and the
  docstring chat dataset (`mbr data mode=chat demo=true`).

Submodules are imported on demand: `import megatron_bridge.data` imports neither torch nor
megatron-core. `python -m megatron_bridge.data ...` is `mbr data ...`.
"""
