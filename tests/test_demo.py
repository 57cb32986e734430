"""The bundled demo model: it loads with no arguments, writes code-like text, and its MTP head drafts well
enough on held-out standard-library files (first-draft acceptance >= 60%) while the speculative output
stays token-exact with plain greedy."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from ds4trt.cli import DEFAULT_MODEL_DIR
from ds4trt.runtime.session import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from train_demo import corpus_files, read_text  # noqa: E402

torch.set_num_threads(1)
DEMO, DEMO_MTP = DEFAULT_MODEL_DIR / "demo.gguf", DEFAULT_MODEL_DIR / "demo-mtp.gguf"


@pytest.fixture(scope="module")
def engine():
    return Engine.open(DEMO, DEMO_MTP)


def test_demo_files_within_size_budget():
    assert DEMO.stat().st_size + DEMO_MTP.stat().st_size <= 25 * 1000 * 1000


def test_run_without_gguf_uses_demo(capsys):
    from ds4trt.cli import run_main
    with pytest.raises(SystemExit) as e:
        run_main(["--raw", "-p", "import os\nimport sys\n\n\ndef ", "-n", "24", "--glm-mtp", "--mtp-margin", "0"])
    assert e.value.code == 0
    out, err = capsys.readouterr()
    text = out.strip()
    assert len(text) > 20 and any(w in text for w in ("self", "return", "def", "(", "="))
    assert "tokens/pass" in err


def test_held_out_acceptance_and_exactness(engine):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    _, held = corpus_files(stdlib)
    texts = [t for t in read_text(held) if len(t) > 2000][:6]
    if len(texts) < 3:
        pytest.skip(f"the standard library at {stdlib} has too few held-out files")
    tok = engine.tokenizer
    drafted = accepted = 0
    for text in texts:
        prompt = tok.encode(text)[:48]
        plain_s = engine.session(48 + 33)
        plain_s.prefill(prompt)
        plain = []
        for _ in range(32):
            plain.append(plain_s.argmax())
            plain_s.eval(plain[-1])
        s = engine.session(48 + 33)
        s.prefill(prompt)
        got = []
        while len(got) < 32:
            got += s.eval_speculative_argmax(s.argmax(), 32 - len(got), None, n_draft=2, margin=0.0)
        assert got == plain
        drafted += s.stats.drafted[0]
        accepted += s.stats.accepted[0]
    assert drafted > 0 and accepted / drafted >= 0.6, (accepted, drafted)
