import time, json
import numpy as np
t0=time.perf_counter()
from mlx_lm.utils import load_tokenizer
from pathlib import Path
MP=Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32")
tw = load_tokenizer(MP)
print("wrapper", type(tw).__name__, "inner", type(tw._tokenizer).__mro__[:3], "eos_ids", tw.eos_token_ids)
import llguidance, llguidance.hf, llguidance.numpy as lgnp
print("llguidance", llguidance.__version__, llguidance.get_version())
t=time.perf_counter()
try:
    ltok = llguidance.hf.from_tokenizer(tw._tokenizer, eos_token=sorted(tw.eos_token_ids))
    print("hf.from_tokenizer ok")
except Exception as e:
    print("hf.from_tokenizer failed:", repr(e))
    ltok = None
t1=time.perf_counter()-t
# direct from the backend tokenizer JSON
t=time.perf_counter()
ltok2 = llguidance.LLTokenizer(tw._tokenizer.backend_tokenizer.to_str(), eos_token=sorted(tw.eos_token_ids))
t2=time.perf_counter()-t
t=time.perf_counter()
ltok3 = llguidance.LLTokenizer(str(MP/"tokenizer.json"), eos_token=sorted(tw.eos_token_ids))
t3=time.perf_counter()-t
print(f"LLTokenizer build: hf={t1*1e3:.0f}ms to_str={t2*1e3:.0f}ms path={t3*1e3:.0f}ms")
ltok = ltok or ltok2
print("vocab_size", ltok.vocab_size, "eos", ltok.eos_token, ltok.eos_tokens, "canonical", ltok.is_canonical)
s = '{"name": "Bob", "age": 42}'
print("tokenize_str vs HF:", ltok.tokenize_str(s), tw.encode(s, add_special_tokens=False) if hasattr(tw,'encode') else None)
schema={"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}
for label, opts in [("default(flexible ws)", None), ("compact", {"whitespace_flexible": False})]:
    g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=opts) if opts else llguidance.LLMatcher.grammar_from_json_schema(schema)
    print(label, "validate:", repr(llguidance.LLMatcher.validate_grammar(g, ltok)))
    t=time.perf_counter(); m = llguidance.LLMatcher(ltok, g, log_level=0); tm=time.perf_counter()-t
    print(f"  matcher build {tm*1e3:.2f}ms err={m.is_error()} {m.get_error()!r}")
    bm = lgnp.allocate_token_bitmask(1, ltok.vocab_size)
    t=time.perf_counter(); lgnp.fill_next_token_bitmask(m, bm, 0); tmask=time.perf_counter()-t
    bits = np.unpackbits(bm.view(np.uint8), bitorder="little")[:ltok.vocab_size]
    allowed = np.nonzero(bits)[0]
    print(f"  first mask {tmask*1e6:.0f}us allowed={len(allowed)}:", [ltok.dbg_tokens([int(a)]) for a in allowed[:12]])
    t=time.perf_counter(); ff = m.compute_ff_tokens(); tff=time.perf_counter()-t
    print(f"  ff tokens {tff*1e6:.0f}us:", ff, ltok.dbg_tokens(ff), "ff_bytes", m.compute_ff_bytes())
