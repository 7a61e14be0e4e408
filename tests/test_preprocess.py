"""glm5-preprocess end to end: exact round trip, bad input accounting, workers, shards, crashes."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data_pipeline import preprocess
from data_pipeline.indexed import DatasetWriter, IndexedDatasetError, check_indexed_dataset, megatron_indexed_dataset
from data_pipeline.readers import JSON_LINE, TEXT_BYTES, TEXT_VALUE, InputError, Record, decode_record, iter_documents
from data_pipeline.tokenizer import load_tokenizer
from data_pipeline.train_tokenizer import save_atomic, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "def f(x):\n    return x ** 2  # square\n",
    "Grüße aus Köln — naïve café; 日本語のテキスト，中文文本，한국어 텍스트。",
    "emoji 👩‍👩‍👧‍👦 🇫🇷 and combining e\u0301 (NFD), zero\u200bwidth, RTL مرحبا שלום",
    "tabs\tand\r\nwindows\rlines, NUL \x00, a literal <|endoftext|> inside, trailing   \n\n",
    "  leading spaces and a final line without newline",
]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    hf = train_tokenizer(DOCS * 20, vocab_size=500)
    return save_atomic(hf, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def run(argv, capsys=None):
    rc = preprocess.main([str(a) for a in argv])
    out = capsys.readouterr() if capsys else None
    return rc, out


def decoded_documents(prefix, tok, append_eod=True):
    dataset = megatron_indexed_dataset().IndexedDataset(str(prefix))
    docs = []
    for i in range(len(dataset)):
        ids = dataset[i]
        if append_eod:
            assert ids[-1] == tok.eod
            ids = ids[:-1]
        assert tok.eod not in ids.tolist()
        docs.append(tok.detokenize(ids))
    return docs


def outputs(directory):
    return sorted(p for p in os.listdir(directory) if p.startswith("out"))


def require_pyarrow():
    """(pyarrow, pyarrow.parquet); a failure, not a skip, without them: the dev extra installs pyarrow,
    so a missing one means parquet reading would go untested."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        pytest.fail("pyarrow is not installed, so parquet input is untested: pip install -e '.[dev]'")
    return pyarrow, pyarrow.parquet


def test_round_trip_jsonl_gz_sources_and_parquet(tmp_path, tok_path, capsys):
    tok = load_tokenizer(tok_path)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": DOCS[1][::-1]}) + "\n")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "__pycache__").mkdir()
    (src / "a.py").write_text(DOCS[0])
    (src / "sub" / "b.c").write_text("int main(void) { return 0; }\n")
    (src / "notes.txt").write_text("excluded by --extensions")
    (src / ".hidden.py").write_text("hidden")
    (src / "__pycache__" / "x.py").write_text("cache")
    expected = DOCS + [DOCS[1][::-1], DOCS[0], "int main(void) { return 0; }\n"]
    pa, pq = require_pyarrow()
    pq.write_table(pa.table({"text": DOCS[2:] + [None]}), tmp_path / "c.parquet")
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", src, tmp_path / "c.parquet"]
    expected += DOCS[2:]
    rc, out = run(["--input", *inputs, "--extensions", ".py,c", "--tokenizer", tok_path,
                   "--output-prefix", tmp_path / "out", "--append-eod", "--workers", "2"], capsys)
    assert rc == 0, out.err
    assert decoded_documents(tmp_path / "out", tok) == expected
    info = check_indexed_dataset(str(tmp_path / "out"), vocab_size=500, full_scan=True, tokenizer=tok)
    assert info.documents == len(expected) and info.meta["tokenizer"]["sha256"] == tok.sha256
    assert info.meta["append_eod"] is True and info.dtype == "uint16"
    assert info.meta["skipped"] == {"missing_field": 1} and f"{tmp_path / 'c.parquet'}:4: column" in out.out
    assert outputs(tmp_path) == ["out.bin", "out.idx", "out.meta.json"]


def test_lines_as_documents_without_eod(tmp_path, tok_path, capsys):
    tok = load_tokenizer(tok_path)
    (tmp_path / "t.txt").write_text("first line\nsecond — línea\n\nfourth\n")
    rc, out = run(["--input", tmp_path / "t.txt", "--lines-as-documents", "--tokenizer", tok_path,
                   "--output-prefix", tmp_path / "out", "--workers", "1"], capsys)
    assert rc == 0
    assert decoded_documents(tmp_path / "out", tok, append_eod=False) == ["first line", "second — línea", "fourth"]
    assert f"{tmp_path / 't.txt'}:3: empty text" in out.out


BAD_JSONL = [
    json.dumps({"text": "good one"}).encode(),          # 1
    b'{"text": "unterminated',                          # 2 malformed_json
    b'{"text": "\xff\xfe bad bytes"}',                  # 3 invalid_utf8
    json.dumps({"text": ""}).encode(),                  # 4 empty_document
    json.dumps({"body": "no text field"}).encode(),     # 5 missing_field
    json.dumps({"text": 5}).encode(),                   # 6 non_string_field
    json.dumps({"text": "good two"}).encode(),          # 7
    b"   ",                                             # 8 empty_document (blank line)
    b'{"text": "lone \\ud800 surrogate"}',              # 9 invalid_utf8
    b"[1, 2]",                                          # 10 malformed_json
    json.dumps({"text": None}).encode(),                # 11 missing_field
    json.dumps({"text": "good three"}).encode(),        # 12
]
BAD_COUNTS = {"malformed_json": 2, "invalid_utf8": 3, "empty_document": 2, "missing_field": 2, "non_string_field": 1}


def write_bad_corpus(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(BAD_JSONL) + b"\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "latin1.txt").write_bytes(b"line one\nline two\ncaf\xe9\n")
    return [tmp_path / "bad.jsonl", tmp_path / "docs"]


def test_skipped_documents_are_counted_per_reason_with_file_and_line(tmp_path, tok_path, capsys):
    tok = load_tokenizer(tok_path)
    rc, out = run(["--input", *write_bad_corpus(tmp_path), "--tokenizer", tok_path,
                   "--output-prefix", tmp_path / "out", "--append-eod", "--workers", "2"], capsys)
    assert rc == 0
    assert decoded_documents(tmp_path / "out", tok) == ["good one", "good two", "good three"]
    assert check_indexed_dataset(str(tmp_path / "out")).meta["skipped"] == BAD_COUNTS
    report, reason = {}, None  # reason -> the origins listed under it
    for line in out.out.splitlines():
        if line.startswith("  ") and not line.startswith("    "):
            reason = line.split(":")[0].strip()
        elif line.startswith("    ") and reason:
            report.setdefault(reason, []).append(line.strip())
    bad = tmp_path / "bad.jsonl"
    for reason, lines in [("malformed_json", [2, 10]), ("invalid_utf8", [3, 9]), ("empty_document", [4, 8]),
                          ("missing_field", [5, 11]), ("non_string_field", [6])]:
        assert [e.split(": ")[0] for e in report[reason] if e.startswith(str(bad))] == [f"{bad}:{n}" for n in lines]
    latin1 = tmp_path / "docs" / "latin1.txt"
    assert f"{latin1}: invalid continuation byte (0xe9) at line 3, byte 21" in report["invalid_utf8"]
    assert "skipped documents: 10" in out.out and "  non_string_field: 1" in out.out


@pytest.mark.parametrize(
    "record, reason",
    [
        (Record(JSON_LINE, "f", 1, b'{"text": "x"}'), None),
        (Record(JSON_LINE, "f", 1, b"{"), "malformed_json"),
        (Record(JSON_LINE, "f", 1, b'"just a string"'), "malformed_json"),
        (Record(JSON_LINE, "f", 1, b'{"text": "\x80"}'), "invalid_utf8"),
        (Record(JSON_LINE, "f", 1, b'{"text": " \\n\\t"}'), "empty_document"),
        (Record(JSON_LINE, "f", 1, b'{"other": "x"}'), "missing_field"),
        (Record(JSON_LINE, "f", 1, b'{"text": ["a"]}'), "non_string_field"),
        (Record(TEXT_BYTES, "f", 0, b"ok\n\xc3"), "invalid_utf8"),
        (Record(TEXT_BYTES, "f", 0, b""), "empty_document"),
        (Record(TEXT_VALUE, "f", 3, None), "missing_field"),
        (Record(TEXT_VALUE, "f", 3, "value"), None),
    ],
)
def test_decode_record_reasons(record, reason):
    text, got, detail = decode_record(record, "text")
    assert got == reason and (text is None) == (reason is not None) and (detail != "") == (reason is not None)


def test_strict_stops_at_first_bad_line(tmp_path, tok_path, capsys):
    rc, out = run(["--input", *write_bad_corpus(tmp_path), "--tokenizer", tok_path, "--strict",
                   "--output-prefix", tmp_path / "out", "--workers", "2"], capsys)
    assert rc == 1
    assert f"{tmp_path / 'bad.jsonl'}:2: malformed_json" in out.err and ":3:" not in out.err
    assert outputs(tmp_path) == []


def test_more_workers_write_identical_files(tmp_path, tok_path):
    corpus = tmp_path / "many.jsonl"
    rng = np.random.default_rng(0)
    docs = [" ".join(DOCS[i % len(DOCS)] for i in rng.integers(0, 50, size=rng.integers(1, 20))) for _ in range(300)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    common = ["--input", corpus, "--tokenizer", tok_path, "--append-eod"]
    assert run(common + ["--output-prefix", tmp_path / "one", "--workers", "1"])[0] == 0
    assert run(common + ["--output-prefix", tmp_path / "two", "--workers", "2", "--batch-bytes", "3000"])[0] == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    assert len(decoded_documents(tmp_path / "two", load_tokenizer(tok_path))) == 300


def test_sharding_and_overwrite(tmp_path, tok_path, capsys):
    tok = load_tokenizer(tok_path)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"{i}: {d}"}) + "\n" for i, d in enumerate(DOCS + DOCS[:2])))
    expected = [f"{i}: {d}" for i, d in enumerate(DOCS + DOCS[:2])]
    common = ["--input", tmp_path / "a.jsonl", "--tokenizer", tok_path, "--append-eod", "--output-prefix", tmp_path / "out"]
    assert run(common + ["--shard-size-docs", "3"], capsys)[0] == 0
    assert outputs(tmp_path) == sorted(["out.meta.json"] + [f"out_0000{i}{s}" for i in range(3) for s in (".bin", ".idx", ".meta.json")])
    info = check_indexed_dataset(str(tmp_path / "out"), vocab_size=500, full_scan=True)
    assert info.prefixes == [str(tmp_path / f"out_0000{i}") for i in range(3)] and info.documents == 7
    assert sum((decoded_documents(p, tok) for p in info.prefixes), []) == expected
    assert [check_indexed_dataset(p).documents for p in info.prefixes] == [3, 3, 1]

    rc, out = run(common, capsys)
    assert rc == 2 and "output exists" in out.err and "--overwrite" in out.err
    assert run(common + ["--overwrite"], capsys)[0] == 0
    assert outputs(tmp_path) == ["out.bin", "out.idx", "out.meta.json"]  # old shards removed
    assert decoded_documents(tmp_path / "out", tok) == expected


def test_exception_mid_write_leaves_nothing_and_rerun_succeeds(tmp_path, tok_path, monkeypatch):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 4))
    argv = ["--input", tmp_path / "a.jsonl", "--tokenizer", tok_path, "--output-prefix", tmp_path / "out",
            "--workers", "1", "--batch-bytes", "200"]
    original, written = DatasetWriter.add_document, []

    def crash_after_five(self, tokens):
        if len(written) == 5:
            raise RuntimeError("simulated crash")
        written.append(1)
        return original(self, tokens)

    monkeypatch.setattr(DatasetWriter, "add_document", crash_after_five)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(argv)
    assert written and outputs(tmp_path) == []
    monkeypatch.setattr(DatasetWriter, "add_document", original)
    assert run(argv)[0] == 0
    assert check_indexed_dataset(str(tmp_path / "out")).documents == len(DOCS) * 4


def test_killed_run_leaves_no_final_files_and_reruns(tmp_path, tok_path):
    rng = np.random.default_rng(1)
    words = ["".join(chr(c) for c in rng.integers(0x61, 0x7B, size=rng.integers(2, 12))) for _ in range(5000)]
    with open(tmp_path / "big.jsonl", "w") as f:
        for _ in range(500):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=1500))}) + "\n")
    argv = ["--input", tmp_path / "big.jsonl", "--tokenizer", tok_path, "--output-prefix", tmp_path / "out",
            "--workers", "1", "--batch-bytes", "20000", "--append-eod"]
    proc = subprocess.Popen([sys.executable, "-m", "data_pipeline.preprocess", *map(str, argv)], cwd=REPO,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / "out.bin.partial"
    deadline = time.time() + 60
    while not (partial.exists() and partial.stat().st_size > 0) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the preprocessor and its workers, mid-write
    assert proc.wait() == -signal.SIGKILL
    assert outputs(tmp_path) == ["out.bin.partial"]
    with pytest.raises(IndexedDatasetError, match=r"out\.meta\.json is missing.*interrupted.*out\.bin\.partial"):
        check_indexed_dataset(str(tmp_path / "out"))
    assert run(argv + ["--workers", "2"])[0] == 0
    assert outputs(tmp_path) == ["out.bin", "out.idx", "out.meta.json"]
    assert check_indexed_dataset(str(tmp_path / "out"), full_scan=True).documents == 500


def test_cli_errors_are_one_line_exit_2(tmp_path, tok_path, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    cases = [
        (["--input", tmp_path / "missing.jsonl", "--tokenizer", tok_path], "input not found"),
        (["--input", tmp_path / "*.none", "--tokenizer", tok_path], "glob matches nothing"),
        (["--input", tmp_path / "a.jsonl", "--tokenizer", tmp_path / "nope.json"], "tokenizer file not found"),
        (["--input", tmp_path / "a.jsonl", "--tokenizer", tok_path, "--json-keys", "a", "b"], "one --json-keys"),
        (["--input", tmp_path / "a.jsonl"], "required: --tokenizer"),
    ]
    for argv, message in cases:
        rc, out = run(argv + ["--output-prefix", tmp_path / "out"], capsys)
        assert rc == 2 and message in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert outputs(tmp_path) == []


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(InputError, match="pip install pyarrow"):
        list(iter_documents([str(tmp_path / "x.parquet")]))
