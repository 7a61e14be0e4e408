"""Corpus to tokenizer to megatron-core indexed datasets, and on to training samples.

Preparing data (CPU, once per corpus):

    python -m data_pipeline.train_tokenizer --input @stdlib --vocab-size 32768 --output tok/tokenizer.json
    glm5-preprocess --input @stdlib --tokenizer tok/tokenizer.json --output-prefix data/stdlib --append-eod

`tokenizer` (any HF tokenizer.json, the object megatron's GPTDataset reads), `train_tokenizer`,
`readers` (JSONL / parquet / text / source trees, bad input counted per reason), `preprocess`,
`indexed` (atomic .bin/.idx/.meta.json writing and load-time checks), `stdlib_corpus` (the default
corpus). The training side (`datasets` and its helpers) reads the resulting prefixes.
"""
