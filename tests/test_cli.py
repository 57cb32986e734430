"""ds4-run: the command-line contract.

stdout carries only the generated text (and a final newline); statistics, notes and MTP logs go to
stderr; every bad input ends with exactly one stderr line "ds4-run: error: ..." naming the file,
tensor, key or option, a non-zero exit code, and no traceback.

Most cases call `ds4trt.cli.run_main(argv)` in-process (capsys); a few run the real `ds4-run`
console script in a subprocess (OMP_NUM_THREADS=1) for the end-to-end contract. Expected outputs
are computed independently through the Python API (Engine / Session / chat.render_single).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds4trt import cli
from ds4trt.chat import Conversation, render_single
from ds4trt.gguf_io import names as N
from ds4trt.runtime.session import Engine, Session
from ds4trt.testing.flash_sparse import write_sparse_flash_gguf
from ds4trt.testing.tiny_gguf import build_tokenizer, tiny_config

PROMPT = "Hello world"
STATS = re.compile(r"^prompt: (\d+) tokens( \((\d+) cached\))?, prefill: ([\d.]+|-) t/s, "
                   r"generation: ([\d.]+|-) t/s \((\d+) tokens\)$")
MTP_STATS = re.compile(r"^mtp: (\d+) tokens in (\d+) target passes \(([\d.]+) tokens/pass\); acceptance (.*)$")


# ---------------------------------------------------------------------------------------------------
# helpers

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the subprocesses get (OMP_NUM_THREADS=1): with two OpenMP threads on a
    two-core machine, any other busy process slows small ops ~100x (barrier waits on a descheduled thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return Engine.open(tiny_gguf)


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    """What ds4-run generates at --temp 0: argmax after each token, stopping after EOS or n tokens."""
    s = engine.session(4096)
    s.prefill(ids)
    out: list[int] = []
    while len(out) < n:
        t = s.argmax()
        out.append(t)
        if t == engine.tokenizer.eos_id:
            break
        s.eval(t)
    return out


def text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != tok.eos_id])


def cli_run(argv, capsys) -> tuple[int, str, str]:
    """run_main in-process: (exit code, stdout, stderr)."""
    try:
        cli.run_main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def stats_lines(err: str) -> list[re.Match]:
    return [m for m in map(STATS.match, err.splitlines()) if m]


def assert_one_line_error(code, out: str, err: str, *needles: str) -> None:
    assert code not in (0, None), (code, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ds4-run: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _exe() -> list[str]:
    script = Path(sys.executable).with_name("ds4-run")
    return [str(script)] if script.exists() else [sys.executable, "-c", "from ds4trt.cli import run_main; run_main()"]


def subprocess_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DS4_MTP_CONF_LOG"}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def ds4_run(args, input: str | None = None, **env) -> subprocess.CompletedProcess:
    """The real console script; stdout/stderr decoded as UTF-8."""
    p = subprocess.run(_exe() + [str(a) for a in args], input=None if input is None else input.encode(),
                       capture_output=True, env=subprocess_env(**env), timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())


# ---------------------------------------------------------------------------------------------------
# 1. -p: stdout is exactly the text, stderr the statistics

def test_prompt_end_to_end(tiny_gguf, engine, tok):
    """The console script: stdout == decode(greedy tokens) + newline; stderr == the statistics line."""
    ids = render_single(tok, PROMPT)
    want = greedy(engine, ids, 8)
    p = ds4_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 8])
    assert p.returncode == 0, p.stderr
    assert p.stdout == text(tok, want) + "\n"
    lines = [line for line in p.stderr.splitlines() if line]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    m = STATS.match(lines[0])
    assert m, lines[0]
    assert int(m[1]) == len(ids) and int(m[6]) == len(want) and m[2] is None


def test_stream_decoding_matches_tokenizer_decode(engine, tok):
    """The streamed text (byte-wise, U+FFFD for broken UTF-8) is the tokenizer's decode of the same ids."""
    want = greedy(engine, render_single(tok, PROMPT), 24)
    stream = tok.stream()
    streamed = "".join(stream.push(t) for t in want if t != tok.eos_id) + stream.flush()
    assert streamed == text(tok, want)


@pytest.mark.parametrize("flags, prompt_ids", [
    ([], lambda tok: render_single(tok, PROMPT)),
    (["--nothink"], lambda tok: render_single(tok, PROMPT, think=False)),
    (["--think"], lambda tok: render_single(tok, PROMPT, think=True)),
    (["--system", "Be brief."], lambda tok: render_single(tok, PROMPT, "Be brief.")),
    (["--system", "Be brief.", "--think"], lambda tok: render_single(tok, PROMPT, "Be brief.", True)),
    (["--raw"], lambda tok: tok.encode(PROMPT)),
], ids=["default", "nothink", "think", "system", "system-think", "raw"])
def test_prompt_format_flags(flags, prompt_ids, tiny_gguf, engine, tok, capsys, monkeypatch):
    """The ids the CLI prefills are what chat.render_single (or tok.encode for --raw) gives, and the
    output is the API's greedy continuation of them."""
    prefilled = []
    real_prefill = Session.prefill
    monkeypatch.setattr(Session, "prefill", lambda self, ids, *a, **k: prefilled.append(list(ids))
                        or real_prefill(self, ids, *a, **k))
    ids = prompt_ids(tok)
    code, out, err = cli_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 6, *flags], capsys)
    assert code == 0, err
    assert prefilled == [ids]
    assert out == text(tok, greedy(engine, ids, 6)) + "\n"
    assert int(stats_lines(err)[0][1]) == len(ids)


def test_prompt_format_flags_differ(tok):
    """The flag variants above really are different prompts (so the parametrized test checks something)."""
    variants = [render_single(tok, PROMPT), render_single(tok, PROMPT, think=True),
                render_single(tok, PROMPT, "Be brief."), tok.encode(PROMPT)]
    assert len({tuple(v) for v in variants}) == len(variants)


def test_sampling_seeded(tiny_gguf, capsys):
    base = ["--gguf", tiny_gguf, "-p", PROMPT, "-n", 16, "--temp", 0.8]
    a = cli_run(base + ["--seed", 1], capsys)
    b = cli_run(base + ["--seed", 1], capsys)
    c = cli_run(base + ["--seed", 2], capsys)
    greedy_out = cli_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 16], capsys)
    assert a[0] == b[0] == c[0] == 0
    assert a[1] == b[1]
    assert a[1] != c[1]          # 16 tokens at temperature 0.8: equal only by a tiny chance
    assert a[1] != greedy_out[1]


@pytest.mark.parametrize("flags", [["--top-k", 1], ["--top-p", 1e-6]], ids=["top-k-1", "top-p-tiny"])
def test_sampling_that_keeps_one_token_is_greedy(flags, tiny_gguf, engine, tok, capsys):
    code, out, err = cli_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 10, "--temp", 0.8, "--seed", 3, *flags],
                             capsys)
    assert code == 0, err
    assert out == text(tok, greedy(engine, render_single(tok, PROMPT), 10)) + "\n"


def test_numerics_float(tiny_gguf, tok, capsys):
    want = greedy(Engine.open(tiny_gguf, numerics="float"), render_single(tok, PROMPT), 8)
    code, out, err = cli_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 8, "--numerics", "float"], capsys)
    assert code == 0, err
    assert out == text(tok, want) + "\n"


def test_zero_tokens(tiny_gguf, capsys):
    code, out, err = cli_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 0], capsys)
    assert code == 0 and out == "\n"
    assert int(stats_lines(err)[0][6]) == 0


def test_context_fills_up(tiny_gguf, tok, capsys):
    """Generation stops at --ctx with a note on stderr, not an error."""
    n_prompt = len(render_single(tok, PROMPT))
    code, out, err = cli_run(["--gguf", tiny_gguf, "-p", PROMPT, "-n", 50, "--ctx", n_prompt + 3], capsys)
    assert code == 0, err
    assert "ds4-run: context full" in err
    assert int(stats_lines(err)[0][6]) <= 3


# ---------------------------------------------------------------------------------------------------
# 2. MTP speculative decoding

MTP_FLAGS = ["--glm-mtp", "--mtp-draft", 3, "--mtp-margin", 0]


def test_mtp_output_is_greedy(tiny_gguf, tiny_mtp_gguf, engine, tok, capsys):
    code, out, err = cli_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, "-p", PROMPT, "-n", 12, *MTP_FLAGS],
                             capsys)
    assert code == 0, err
    want = greedy(engine, render_single(tok, PROMPT), 12)
    assert out == text(tok, want) + "\n"
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 2 and STATS.match(lines[0]), err
    m = MTP_STATS.match(lines[1])
    assert m, lines[1]
    assert int(m[1]) == len(want)
    assert "d1=" in m[4] and "d3=" in m[4] and "d4=" not in m[4]   # margin 0: drafts 3 whenever there is room


def test_mtp_conf_log(tiny_gguf, tiny_mtp_gguf, engine, tok, capsys, monkeypatch):
    """DS4_MTP_CONF_LOG=1: one "mtp pos=" line per draft/verify cycle, on stderr only."""
    monkeypatch.setenv("DS4_MTP_CONF_LOG", "1")
    code, out, err = cli_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, "-p", PROMPT, "-n", 10, *MTP_FLAGS],
                             capsys)
    assert code == 0, err
    assert out == text(tok, greedy(engine, render_single(tok, PROMPT), 10)) + "\n"
    cycles = [line for line in err.splitlines() if line.startswith("mtp pos=")]
    passes = int(next(m for m in map(MTP_STATS.match, err.splitlines()) if m)[2])
    assert len(cycles) == passes >= 1


def test_mtp_end_to_end(tiny_gguf, tiny_mtp_gguf, engine, tok):
    p = ds4_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, "-p", PROMPT, "-n", 8, *MTP_FLAGS],
                DS4_MTP_CONF_LOG="1")
    assert p.returncode == 0, p.stderr
    assert p.stdout == text(tok, greedy(engine, render_single(tok, PROMPT), 8)) + "\n"
    assert "mtp pos=" in p.stderr and "tokens/pass); acceptance" in p.stderr and "Traceback" not in p.stderr


def test_mtp_with_sampling_decodes_normally(tiny_gguf, tiny_mtp_gguf, capsys):
    """--mtp with --temp > 0: a note that MTP needs greedy, then the same sampled text as without --mtp."""
    sample = ["-p", PROMPT, "-n", 10, "--temp", 0.7, "--seed", 5]
    code, out, err = cli_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, *sample], capsys)
    assert code == 0, err
    assert "needs greedy" in err and "decoding normally" in err
    assert not any(line.startswith("mtp:") for line in err.splitlines())
    assert (code, out) == cli_run(["--gguf", tiny_gguf, *sample], capsys)[:2]


@pytest.mark.parametrize("draft", [0, 9, -1])
def test_mtp_draft_out_of_range(draft, tiny_gguf, tiny_mtp_gguf, capsys):
    code, out, err = cli_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, "--glm-mtp", "-p", PROMPT,
                              "--mtp-draft", draft], capsys)
    assert_one_line_error(code, out, err, "--mtp-draft", str(draft))
    assert out == ""


# ---------------------------------------------------------------------------------------------------
# 3. bad input: one line on stderr, non-zero exit, no traceback

def _patched(tiny_gguf: Path, tmp_path: Path, name: str, edit) -> Path:
    path = tmp_path / name
    path.write_bytes(edit(tiny_gguf.read_bytes()))
    return path


# Each row: id -> (argv builder(ctx) , substrings the error line must contain). ctx has tiny_gguf,
# tiny_mtp_gguf, tmp_path and write_tiny. "{}" in a needle is replaced by the file's path.
BAD_INPUTS = {
    # --gguf names nothing
    "missing-file": (lambda c: ["--gguf", c.tmp_path / "nope.gguf", "-p", "hi"], ["nope.gguf", "no such file"]),
    # --gguf names a directory
    "directory": (lambda c: ["--gguf", c.tmp_path, "-p", "hi"], ["is a directory"]),
    # 4 KiB of random bytes: no GGUF magic
    "not-gguf": (lambda c: ["--gguf", _write(c.tmp_path / "random.gguf", os.urandom(4096)), "-p", "hi"],
                 ["random.gguf", "not a GGUF file"]),
    # a valid file with the version field (bytes 4..8) set to 2
    "version-2": (lambda c: ["--gguf", _patched(c.tiny_gguf, c.tmp_path, "v2.gguf",
                                                lambda b: b[:4] + (2).to_bytes(4, "little") + b[8:]), "-p", "hi"],
                  ["v2.gguf", "version 2"]),
    # only the first 20 bytes: the header is cut inside n_kv
    "truncated-header": (lambda c: ["--gguf", _patched(c.tiny_gguf, c.tmp_path, "hdr.gguf", lambda b: b[:20]),
                                    "-p", "hi"], ["hdr.gguf", "truncated"]),
    # the last 1000 bytes of tensor data missing
    "truncated-data": (lambda c: ["--gguf", _patched(c.tiny_gguf, c.tmp_path, "cut.gguf", lambda b: b[:-1000]),
                                  "-p", "hi"], ["cut.gguf", "tensor ", "past the end of the file"]),
    # an empty file
    "empty-file": (lambda c: ["--gguf", _write(c.tmp_path / "empty.gguf", b""), "-p", "hi"],
                   ["empty.gguf", "empty"]),
    # the LM head left out
    "missing-tensor": (lambda c: ["--gguf", c.write_tiny("drop.gguf", drop=[N.OUTPUT]), "-p", "hi"],
                       ["drop.gguf", N.OUTPUT, "missing"]),
    # the LM head as Q4_K instead of Q8_0
    "wrong-type": (lambda c: ["--gguf", c.write_tiny("retype.gguf", retype={N.OUTPUT: N.Q4_K}), "-p", "hi"],
                   ["retype.gguf", N.OUTPUT, "expected type Q8_0, got Q4_K"]),
    # the LM head with 500 rows instead of 512
    "wrong-shape": (lambda c: ["--gguf", c.write_tiny("reshape.gguf", reshape={N.OUTPUT: (256, 500)}), "-p", "hi"],
                    ["reshape.gguf", N.OUTPUT, "expected ggml shape [256, 512], got [256, 500]"]),
    # embedding_length says 512, the tensors are 256 wide
    "metadata-vs-shapes": (lambda c: ["--gguf", c.write_tiny("md.gguf", metadata_overrides={N.KEY_EMBD: 512}),
                                      "-p", "hi"], ["md.gguf", "tensor ", "expected ggml shape"]),
    # no attention.head_count key
    "missing-key": (lambda c: ["--gguf", c.write_tiny("nokey.gguf", drop_keys=[N.KEY_HEAD]), "-p", "hi"],
                    ["nokey.gguf", N.KEY_HEAD, "missing"]),
    # a key of the wrong GGUF type
    "key-wrong-type": (lambda c: ["--gguf", c.write_tiny("keytype.gguf", metadata_overrides={N.KEY_EMBD: "wide"}),
                                  "-p", "hi"], ["keytype.gguf", N.KEY_EMBD, "expected u32"]),
    # block_count 0 (the per-layer arrays were indexed before the count was checked)
    "zero-layers": (lambda c: ["--gguf", c.write_tiny("layers0.gguf", metadata_overrides={N.KEY_BLOCK_COUNT: 0}),
                               "-p", "hi"], ["layers0.gguf", N.KEY_BLOCK_COUNT]),
    # a 300-entry vocabulary for a 512-row model: generated ids could not be decoded
    "vocab-too-small": (lambda c: ["--gguf", c.write_tiny("vocab.gguf", tokenizer=build_tokenizer(300)),
                                   "-p", "hi"], ["vocab.gguf", "tokenizer.ggml.tokens", "300", "512"]),
    # a 512-entry vocabulary for a 300-row model: prompt ids could not be embedded
    "vocab-too-large": (lambda c: ["--gguf", c.write_tiny("vocab2.gguf", cfg=tiny_config(n_vocab=300),
                                                          tokenizer=build_tokenizer(512)), "-p", "hi"],
                        ["vocab2.gguf", "tokenizer.ggml.tokens"]),
    # the MTP file given as the target
    "mtp-as-target": (lambda c: ["--gguf", c.tiny_mtp_gguf, "-p", "hi"], ["tiny-mtp.gguf", "missing"]),
    # a prompt that does not fit in --ctx 4
    "prompt-over-ctx": (lambda c: ["--gguf", c.tiny_gguf, "--ctx", 4, "-p", "a long prompt that needs many tokens"],
                        ["does not fit", "--ctx 4"]),
    # --ctx above the model's context_length (4096)
    "ctx-over-model": (lambda c: ["--gguf", c.tiny_gguf, "--ctx", 10 ** 12, "-p", "hi"],
                       ["--ctx 1000000000000", "context length 4096"]),
    # --mtp pointing at the target itself
    "mtp-not-mtp": (lambda c: ["--gguf", c.tiny_gguf, "--mtp", c.tiny_gguf, "--glm-mtp", "-p", "hi"],
                    ["tiny.gguf", "not an MTP GGUF"]),
    # an MTP head built for a 512-wide target
    "mtp-wrong-shapes": (lambda c: ["--gguf", c.tiny_gguf, "--mtp", c.write_tiny("mtp512.gguf", mtp=True,
                                                                                 cfg=tiny_config(n_embd=512)),
                                    "--glm-mtp", "-p", "hi"], ["mtp512.gguf", "tensor mtp.0.", "expected ggml shape"]),
    # an MTP file that does not exist
    "mtp-missing-file": (lambda c: ["--gguf", c.tiny_gguf, "--mtp", c.tmp_path / "no-mtp.gguf", "-p", "hi"],
                         ["no-mtp.gguf", "no such file"]),
    # --glm-mtp with an explicit target but no head
    "glm-mtp-without-mtp": (lambda c: ["--gguf", c.tiny_gguf, "--glm-mtp", "-p", "hi"], ["--glm-mtp", "--mtp"]),
    # a prompt with a byte that is not UTF-8 (argv arrives surrogate-escaped)
    "prompt-not-utf8": (lambda c: ["--gguf", c.tiny_gguf, "-p", "bad \udcff byte"], ["-p", "UTF-8", "0xff"]),
    # a system prompt with a byte that is not UTF-8
    "system-not-utf8": (lambda c: ["--gguf", c.tiny_gguf, "--system", "\udcfe", "-p", "hi"],
                        ["--system", "UTF-8", "0xfe"]),
    # --raw with an empty prompt: no token to continue from
    "raw-empty-prompt": (lambda c: ["--gguf", c.tiny_gguf, "--raw", "-p", ""], ["-p", "empty"]),
    # option values out of range
    "n-negative": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "-n", -1], ["-n"]),
    "ctx-zero": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "--ctx", 0], ["--ctx"]),
    "temp-negative": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "--temp", -1], ["--temp"]),
    "temp-nan": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "--temp", "nan"], ["--temp"]),
    "top-p-zero": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "--temp", 1, "--top-p", 0], ["--top-p"]),
    "top-k-negative": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "--temp", 1, "--top-k", -2], ["--top-k"]),
    "seed-overflow": (lambda c: ["--gguf", c.tiny_gguf, "-p", "hi", "--temp", 1, "--seed", 10 ** 30], ["--seed"]),
    # --device with an engine directory (it runs on the backend its manifest names)
    "device-with-engines": (lambda c: ["--engines", c.tmp_path, "--device", "cpu", "-p", "hi"],
                            ["--device", "--engines"]),
}
if not torch.cuda.is_available():
    # --compile without a GPU (the CPU reference is not compiled)
    BAD_INPUTS["compile-on-cpu"] = (lambda c: ["--gguf", c.tiny_gguf, "--device", "cpu", "--compile", "-p", "hi"],
                                    ["--compile", "--device cuda"])
    # --device cuda where PyTorch sees no GPU
    BAD_INPUTS["device-cuda-without-gpu"] = (lambda c: ["--gguf", c.tiny_gguf, "--device", "cuda", "-p", "hi"],
                                             ["--device cuda", "no CUDA device"])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


class _Ctx:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("row", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input(row, tiny_gguf, tiny_mtp_gguf, tmp_path, write_tiny, capsys):
    build, needles = BAD_INPUTS[row]
    argv = build(_Ctx(tiny_gguf=tiny_gguf, tiny_mtp_gguf=tiny_mtp_gguf, tmp_path=tmp_path, write_tiny=write_tiny))
    code, out, err = cli_run(argv, capsys)
    assert_one_line_error(code, out, err, *needles)
    assert out == ""


@pytest.mark.parametrize("row", ["truncated-data", "mtp-wrong-shapes", "prompt-over-ctx"])
def test_bad_input_end_to_end(row, tiny_gguf, tiny_mtp_gguf, tmp_path, write_tiny):
    """The console script itself: exit 1, one stderr line, nothing on stdout."""
    build, needles = BAD_INPUTS[row]
    argv = build(_Ctx(tiny_gguf=tiny_gguf, tiny_mtp_gguf=tiny_mtp_gguf, tmp_path=tmp_path, write_tiny=write_tiny))
    p = ds4_run(argv)
    assert p.returncode == 1
    assert_one_line_error(p.returncode, p.stdout, p.stderr, *needles)
    assert p.stdout == ""


def test_broken_pipe_is_quiet(tiny_gguf):
    """stdout closed by the reader (ds4-run ... | head): exit 141, no traceback."""
    p = subprocess.Popen(_exe() + ["--gguf", str(tiny_gguf), "-p", PROMPT, "-n", "40"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=subprocess_env())
    p.stdout.close()   # before the model has even loaded: the first write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert "Traceback" not in err and "Error" not in err, err


# ---------------------------------------------------------------------------------------------------
# 4. --info on the real-scale (sparse) Flash file

@pytest.fixture(scope="module")
def flash_gguf(tmp_path_factory):
    return write_sparse_flash_gguf(tmp_path_factory.mktemp("flash") / "flash.gguf")


def test_info_flash_in_process(flash_gguf, capsys, monkeypatch):
    """--info reads the metadata and the tensor directory only: any dequantization fails the test."""
    import ds4trt.model.weights as W

    def forbidden(*a, **k):
        raise AssertionError("--info dequantized a tensor")
    for name in ("dequantize", "dequantize_rows", "as_int32"):
        monkeypatch.setattr(W, name, forbidden)
    monkeypatch.setattr(W.Weights, "get", forbidden)
    t0 = time.perf_counter()
    code, out, err = cli_run(["--gguf", flash_gguf, "--info"], capsys)
    elapsed = time.perf_counter() - t0
    assert code == 0 and err == "", err
    assert elapsed < 3.0, elapsed
    for needle in ("[DeepSeek V4 Flash shape]", "layers       43:", "D=4096", "256 routed (top 6)",
                   "vocab        129280", "parameters   284.", "GGUF v3", "tokenizer    129280 tokens"):
        assert needle in out, (needle, out)


def test_info_flash_end_to_end(flash_gguf):
    """The console script: exit 0, a few seconds, a few hundred MB at most (the file holds ~80 GB)."""
    p = subprocess.Popen(_exe() + ["--gguf", str(flash_gguf), "--info"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=subprocess_env())
    out, err = p.stdout.read().decode(), p.stderr.read().decode()
    _, status, usage = os.wait4(p.pid, 0)     # this child's own peak RSS
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0, err
    assert "[DeepSeek V4 Flash shape]" in out and "vocab        129280" in out
    assert usage.ru_maxrss < 1_500_000, f"peak RSS {usage.ru_maxrss} KiB"   # KiB on Linux


def test_info_tiny(tiny_gguf, capsys):
    code, out, err = cli_run(["--gguf", tiny_gguf, "--info"], capsys)
    assert code == 0, err
    assert "layers       6:" in out and "tokenizer    512 tokens" in out and "Flash shape" not in out


# ---------------------------------------------------------------------------------------------------
# 5. interactive chat on stdin

USER_LINES = ["Hello world", "How are you"]


def chat_reference(engine: Engine, lines: list[str], n: int) -> list[str]:
    """Each turn from a fresh session over the whole re-rendered conversation (no cache reuse)."""
    tok = engine.tokenizer
    conv, replies = Conversation(), []
    for line in lines:
        conv.append("user", line)
        got = greedy(engine, conv.render(tok), n)
        replies.append(text(tok, got))
        conv.append("assistant", replies[-1])
    return replies


def test_interactive_end_to_end(tiny_gguf, engine):
    p = ds4_run(["--gguf", tiny_gguf, "-n", 8], input="\n".join(USER_LINES) + "\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "".join(r + "\n" for r in chat_reference(engine, USER_LINES, 8))
    assert len(stats_lines(p.stderr)) == 2 and "Traceback" not in p.stderr


@pytest.mark.parametrize("n", [0, 1, 8])
def test_interactive_reuses_the_cache(n, tiny_gguf, engine, tok, capsys, monkeypatch):
    """Turn 2 keeps the common prefix of the cache: only the new tokens are prefilled when the reply
    re-encodes to the generated tokens (-n 0, -n 1), a rewind to the common prefix otherwise; the
    first turn never rewinds (and never replays). Blank lines are skipped."""
    calls = []
    real_prefill, real_rewind = Session.prefill, Session.rewind
    monkeypatch.setattr(Session, "prefill", lambda self, ids, *a, **k: calls.append(("prefill", len(ids)))
                        or real_prefill(self, ids, *a, **k))
    monkeypatch.setattr(Session, "rewind", lambda self, pos: calls.append(("rewind", pos)) or real_rewind(self, pos))
    monkeypatch.setattr(sys, "stdin", io.StringIO(USER_LINES[0] + "\n\n" + USER_LINES[1] + "\n"))
    code, out, err = cli_run(["--gguf", tiny_gguf, "-n", n], capsys)
    seen = list(calls)                              # the references below run prefill too
    assert code == 0, err
    assert out == "".join(r + "\n" for r in chat_reference(engine, USER_LINES, n))

    conv = Conversation([("user", USER_LINES[0])])
    ids1 = conv.render(tok)
    gen1 = greedy(engine, ids1, n)
    conv.append("assistant", text(tok, gen1)).append("user", USER_LINES[1])
    ids2 = conv.render(tok)
    held = ids1 + gen1                              # the session after turn 1
    common = next((i for i, (a, b) in enumerate(zip(held, ids2)) if a != b), min(len(held), len(ids2)))
    turn2 = [("prefill", len(ids2) - len(held))] if common == len(held) else \
        [("rewind", common)] + ([("prefill", common)] if common else []) + [("prefill", len(ids2) - common)]
    assert seen == [("prefill", len(ids1))] + turn2

    s1, s2 = stats_lines(err)
    assert int(s1[1]) == len(ids1) and s1[2] is None
    assert int(s2[1]) == len(ids2)
    if common == len(held):
        assert int(s2[3]) == len(held)             # "(N cached)"
    if n <= 1:
        assert common == len(held)                 # these short replies do round-trip


@pytest.mark.parametrize("warm", [True, False])
def test_interactive_warms_up_each_turn(warm, tiny_gguf, tiny_mtp_gguf, capsys, monkeypatch):
    """Each turn warms up the steps of its reply, from the position after its prompt to -n tokens later (with the
    MTP drafts), after its prefill and before its first token; nothing before the first line is read, nothing with
    --no-warm-up."""
    events = []
    real_prefill, real_eval = Session.prefill, Session.eval_speculative_argmax

    def prefill(self, ids, *a, **k):
        out = real_prefill(self, ids, *a, **k)
        events.append(("prefill", self.pos))
        return out

    def warm_up(self, n_draft=0, first=0, end=None):
        events.append(("warm_up", n_draft, first, end))
        return 0

    def decode(self, *a, **k):
        events.append(("decode",))
        return real_eval(self, *a, **k)
    monkeypatch.setattr(Session, "prefill", prefill)
    monkeypatch.setattr(Session, "warm_up", warm_up)
    monkeypatch.setattr(Session, "eval_speculative_argmax", decode)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(USER_LINES) + "\n"))
    code, _, err = cli_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, "-n", 5, *MTP_FLAGS,
                            *([] if warm else ["--no-warm-up"])], capsys)
    assert code == 0, err
    assert events[0][0] == "prefill"
    warms = [i for i, e in enumerate(events) if e[0] == "warm_up"]
    assert len(warms) == (2 if warm else 0)
    for i in warms:                       # right after the turn's (last) prefill, right before its first token
        pos = events[i - 1][1]
        assert events[i - 1][0] == "prefill" and events[i + 1] == ("decode",)
        assert events[i] == ("warm_up", MTP_FLAGS[MTP_FLAGS.index("--mtp-draft") + 1], pos, pos + 5)


def test_interactive_with_mtp_is_greedy(tiny_gguf, tiny_mtp_gguf, engine, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(USER_LINES) + "\n"))
    code, out, err = cli_run(["--gguf", tiny_gguf, "--mtp", tiny_mtp_gguf, "-n", 8, *MTP_FLAGS], capsys)
    assert code == 0, err
    assert out == "".join(r + "\n" for r in chat_reference(engine, USER_LINES, 8))


def test_interactive_empty_stdin(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli_run(["--gguf", tiny_gguf], capsys) == (0, "", "")


@pytest.mark.parametrize("make_stdin, line, answered", [
    # argv/stdin bytes arrive surrogate-escaped (Python's default for stdin under a UTF-8 locale)
    (lambda: io.StringIO("hi\nbad \udcff\n"), 2, 1),
    # a strict stdin encoding (PYTHONIOENCODING=utf-8): readline itself raises UnicodeDecodeError
    (lambda: io.TextIOWrapper(io.BytesIO(b"bad \xff\n"), encoding="utf-8", errors="strict"), 1, 0),
], ids=["surrogateescape", "strict"])
def test_interactive_bad_utf8_line(make_stdin, line, answered, tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", make_stdin())
    code, out, err = cli_run(["--gguf", tiny_gguf, "-n", 2], capsys)
    assert code == 1 and "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("ds4-run: error:")]
    assert len(errors) == 1 and f"stdin line {line} " in errors[0] and "utf-8" in errors[0].lower(), err
    assert len(stats_lines(err)) == answered
