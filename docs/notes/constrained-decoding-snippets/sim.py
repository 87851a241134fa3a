"""Simulated speculative greedy decoding under a grammar vs constrained plain greedy.
Target = fixed pseudo-random logits per (history hash); drafts = true continuation
with random corruption + grammar ff tokens as a prefix."""
import time, hashlib, random
import numpy as np, mlx.core as mx
from mlx_lm.utils import load_tokenizer
from pathlib import Path
import llguidance, llguidance.hf, llguidance.numpy as lgnp
tw = load_tokenizer(Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32"))
EOS = 2
lt = llguidance.hf.from_tokenizer(tw._tokenizer, n_vocab=49152, eos_token=[EOS])
V = lt.vocab_size; W = (V + 31) // 32
schema = {"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":False}
G = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
shifts = mx.arange(32, dtype=mx.uint32)
@mx.compile
def masked(words, logits):
    bits = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(bits.astype(mx.bool_), logits, -mx.inf)
def target_logits(hist):  # deterministic stand-in for the model, rows for each prefix
    out = []
    for h in hist:
        seed = int.from_bytes(hashlib.blake2b(np.array(h, np.int32).tobytes(), digest_size=4).digest(), "little")
        out.append(np.random.default_rng(seed).standard_normal(V).astype(np.float32))
    return mx.array(np.stack(out))
def plain(n_max):
    m = llguidance.LLMatcher(lt, G, log_level=0); hist=[1]; out=[]; bm = lgnp.allocate_token_bitmask(1, V)
    while len(out) < n_max:
        lgnp.fill_next_token_bitmask(m, bm, 0)
        t = int(mx.argmax(masked(mx.array(bm).view(mx.uint32), target_logits([hist])), -1).item())
        out.append(t); hist.append(t)
        if t == EOS: break
        assert m.consume_token(t)
    return out
def spec(n_max, k=6, rng=random.Random(0), reference=None):
    m = llguidance.LLMatcher(lt, G, log_level=0); hist=[1]; out=[]; forwards=0; n_ff=0
    while len(out) < n_max:
        budget = min(k, n_max - len(out) - 1)
        ff = m.compute_ff_tokens()[:budget] if budget > 0 else []
        n_ff += len(ff)
        # "drafter": the reference continuation after hist+ff, corrupted at random
        pos = len(out) + len(ff)
        d = list(reference[pos: pos + budget - len(ff)]) if budget > len(ff) else []
        d = [t if rng.random() > 0.2 else rng.randrange(V) for t in d]
        block = ff + d
        # masks for k+1 rows, truncating at the first forbidden or stop token (matcher advanced)
        bm = np.full((len(block) + 1, W), -1, np.int32); n_ok = 0
        for i, t in enumerate(block):
            lgnp.fill_next_token_bitmask(m, bm, i)
            if t == EOS or not (bm[i, t >> 5] >> (t & 31)) & 1: break
            assert m.consume_token(t); n_ok += 1
        block = block[:n_ok]
        lgnp.fill_next_token_bitmask(m, bm, n_ok)
        rows = masked(mx.array(bm[: n_ok + 1]).view(mx.uint32), target_logits([hist + block[:i] for i in range(n_ok + 1)]))
        forwards += 1
        tgt = mx.argmax(rows, -1).tolist()
        n_acc = 0
        while n_acc < n_ok and tgt[n_acc] == block[n_acc]: n_acc += 1
        tok = tgt[n_acc]
        assert m.rollback(n_ok - n_acc), m.get_error()
        committed = block[:n_acc] + [tok]
        out += committed; hist += committed
        if tok == EOS: break
        assert m.consume_token(tok), m.get_error()
    return out[:n_max] if EOS not in out else out[: out.index(EOS) + 1], forwards, n_ff
t0 = time.perf_counter(); ref = plain(80); tp = time.perf_counter() - t0
print("plain:", len(ref), "tokens", repr(lt.decode_str([t for t in ref if t != EOS]))[:120], f"{tp:.2f}s")
t0 = time.perf_counter(); sp, fw, nff = spec(80, reference=ref); ts = time.perf_counter() - t0
print("spec :", len(sp), "tokens in", fw, "forwards; ff tokens drafted:", nff, "identical:", sp == ref, f"{ts:.2f}s")
