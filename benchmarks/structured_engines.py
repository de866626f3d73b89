"""xgrammar against llguidance on the default model's tokenizer: which JSON Schema keywords each
compiles (and whether it refuses or ignores the rest), compile time per schema, and the per-step
cost of 64 masks (fill, then apply) while 64 matchers walk a nested schema on random logits.

Both engines without their dependencies, beside the project's environment (xgrammar's metadata
would pull triton into it):
    pip install --no-deps --target /tmp/engines xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1
    PYTHONPATH=/tmp/engines python3 benchmarks/structured_engines.py
"""
import json
import time

import torch
from transformers import AutoTokenizer
from pagedrun.models.default_model import default_model_dir

d = default_model_dir()
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=False, local_files_only=True)
V = 49152
SCHEMAS = {
 "basic": {"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":False},
 "enum": {"type":"object","properties":{"label":{"enum":["positive","negative","neutral"]}},"required":["label"]},
 "nested_array": {"type":"object","properties":{"people":{"type":"array","items":{"type":"object","properties":{"name":{"type":"string"},"email":{"type":"string","format":"email"}},"required":["name"]},"minItems":1,"maxItems":5}},"required":["people"]},
 "ref": {"$defs":{"p":{"type":"object","properties":{"x":{"type":"number"}},"required":["x"]}},"type":"object","properties":{"a":{"$ref":"#/$defs/p"},"b":{"$ref":"#/$defs/p"}},"required":["a"]},
 "recursive_ref": {"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"]}},"$ref":"#/$defs/node"},
 "anyOf": {"anyOf":[{"type":"string"},{"type":"integer"}]},
 "oneOf": {"oneOf":[{"type":"object","properties":{"k":{"const":"a"}},"required":["k"]},{"type":"object","properties":{"k":{"const":"b"}},"required":["k"]}]},
 "allOf": {"allOf":[{"type":"object","properties":{"a":{"type":"string"}},"required":["a"]},{"properties":{"b":{"type":"integer"}},"required":["b"]}]},
 "pattern": {"type":"string","pattern":"^[A-Z]{3}-[0-9]{4}$"},
 "string_len": {"type":"string","minLength":3,"maxLength":8},
 "int_range": {"type":"integer","minimum":10,"maximum":99},
 "num_exclusive": {"type":"number","exclusiveMinimum":0,"exclusiveMaximum":1},
 "format_date": {"type":"string","format":"date"},
 "format_datetime": {"type":"string","format":"date-time"},
 "format_uuid": {"type":"string","format":"uuid"},
 "patternProperties": {"type":"object","patternProperties":{"^x_":{"type":"integer"}},"additionalProperties":False},
 "additional_schema": {"type":"object","additionalProperties":{"type":"integer"}},
 "type_list": {"type":["string","null"]},
 "const": {"const":{"a":1}},
 "prefixItems": {"type":"array","prefixItems":[{"type":"string"},{"type":"integer"}],"items":False},
 "if_then": {"type":"object","if":{"properties":{"a":{"const":1}}},"then":{"required":["b"]}},
 "not": {"not":{"type":"string"}},
 "uniqueItems": {"type":"array","items":{"type":"integer"},"uniqueItems":True},
 "multipleOf": {"type":"integer","multipleOf":5},
 "minProperties": {"type":"object","minProperties":1},
 "dependentRequired": {"type":"object","properties":{"a":{"type":"string"},"b":{"type":"string"}},"dependentRequired":{"a":["b"]}},
}
res = {}
import xgrammar as xgr
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
comp = xgr.GrammarCompiler(info, cache_enabled=False)
xg_ok = {}
for k, s in SCHEMAS.items():
    t = time.perf_counter()
    try:
        g = comp.compile_json_schema(json.dumps(s), any_whitespace=False); xg_ok[k] = (True, (time.perf_counter()-t)*1e3)
    except Exception as e:
        xg_ok[k] = (False, str(e)[:80])
import llguidance, llguidance.hf, llguidance.torch as lgt
t0=time.perf_counter()
lt = llguidance.hf.from_tokenizer(tok, n_vocab=V)
print("llg tokenizer build ms", (time.perf_counter()-t0)*1e3)
lg_ok = {}
for k, s in SCHEMAS.items():
    t = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
    ok, err = True, None
    m = llguidance.LLMatcher(lt, g)
    if m.is_error():
        ok, err = False, m.get_error()[:80]
    lg_ok[k] = (ok, (time.perf_counter()-t)*1e3 if ok else err)
print(f"{'schema':20s} {'xgrammar':30s} llguidance")
for k in SCHEMAS:
    print(f"{k:20s} {str(xg_ok[k][0])+' '+(f'{xg_ok[k][1]:.2f}ms' if xg_ok[k][0] else xg_ok[k][1][:40]):30s} {lg_ok[k][0]} {f'{lg_ok[k][1]:.2f}ms' if lg_ok[k][0] else lg_ok[k][1][:60]}")
print("xg supported", sum(v[0] for v in xg_ok.values()), "lg supported", sum(v[0] for v in lg_ok.values()), "of", len(SCHEMAS))

# speed: 64 matchers, fill masks per step, walk greedy on random-ish logits with the "basic" / nested schema
B=64
torch.manual_seed(0)
def run_xg():
    g = comp.compile_json_schema(json.dumps(SCHEMAS["nested_array"]), any_whitespace=False)
    ms = [xgr.GrammarMatcher(g) for _ in range(B)]
    bm = xgr.allocate_token_bitmask(B, V)
    fill=app=0; steps=0
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        live=[i for i,m in enumerate(ms) if not m.is_terminated()]
        if not live: break
        logits = torch.randn(B, V, generator=gen)
        t=time.perf_counter()
        for i in live: ms[i].fill_next_token_bitmask(bm, i)
        t2=time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bm)
        t3=time.perf_counter()
        fill+=t2-t; app+=t3-t2; steps+=1
        toks = logits.argmax(-1).tolist()
        for i in live: assert ms[i].accept_token(toks[i])
    return fill/steps*1e3, app/steps*1e3, steps
def run_lg():
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS["nested_array"], defaults={"whitespace_flexible": False})
    ms = [llguidance.LLMatcher(lt, g) for _ in range(B)]
    bm = lgt.allocate_token_bitmask(B, V)
    fill=app=0; steps=0
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        live=[i for i,m in enumerate(ms) if not m.is_stopped()]
        if not live: break
        logits = torch.randn(B, V, generator=gen)
        t=time.perf_counter()
        for i in live: lgt.fill_next_token_bitmask(ms[i], bm, i)
        t2=time.perf_counter()
        lgt.apply_token_bitmask_inplace(logits, bm)
        t3=time.perf_counter()
        fill+=t2-t; app+=t3-t2; steps+=1
        toks = logits.argmax(-1).tolist()
        for i in live: assert ms[i].consume_token(toks[i]), ms[i].get_error()
    return fill/steps*1e3, app/steps*1e3, steps
print("xgrammar fill/apply ms per step (64 rows):", run_xg())
print("llguidance fill/apply ms per step (64 rows):", run_lg())
# compile timing cold for basic
for name in ["basic", "nested_array"]:
    t=time.perf_counter(); comp.compile_json_schema(json.dumps(SCHEMAS[name]), any_whitespace=False); a=(time.perf_counter()-t)*1e3
    t=time.perf_counter(); m=llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS[name], defaults={"whitespace_flexible": False})); b=(time.perf_counter()-t)*1e3
    print(name, f"compile xg {a:.2f} ms, llg {b:.2f} ms")
