/**
 * The int8 prefill kernels inside the forward pass, on a real model: the shipped demo model (Q8_0) reads a passage
 * teacher-forced with its prefill projections, then its prefill attention, on the dot4I8Packed kernels (which every
 * adapter runs) and on f32. The int8 activations (one scale per 32 elements) move its logits by about what llama.cpp's
 * MMQ does, the 8-bit attention by less: the bounds below are loose enough for that and far too tight for a wrong
 * block scale, code or row.
 */
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { DEMO_MODEL_FILE } from '../cli/default-model.ts';
import { logProbability } from '../eval/perplexity.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { KvPagePool } from '../kv/pool.ts';
import { defaultPrefillChunk, type LoadOptions, ModelRunner } from './model-runner.ts';

const ctx = withTestGpu();
const demoPath = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'public', 'models', DEMO_MODEL_FILE);

const PASSAGE =
  'It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of ' +
  'a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, ' +
  'this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful ' +
  'property of some one or other of their daughters.';

type Kernels = Pick<LoadOptions, 'prefillMatmul' | 'prefillAttention'>;

async function forcedLogits(kernels: Kernels) {
  const engine = new ModelRunner(ctx.gpu);
  const source = await sourceFromPath(demoPath);
  try {
    const config = await engine.load(source, { kv: 'f16', prefillChunk: 64, ...kernels });
    const ids = engine.tokenizer.encode(PASSAGE, { addSpecial: true }).slice(0, 96);
    const body = engine.loaded?.transformer.graph(64).body ?? [];
    return {
      ids,
      vocab: config.vocab,
      layers: config.layers,
      logits: await engine.teacherForcedLogits(ids),
      quantizes: body.filter((d) => d.label.endsWith('.quantize')).length,
      swiglus: body.filter((d) => d.label.endsWith('.swiglu')).length,
      hiddenBytes: engine.loaded?.transformer.buffers.hidden.size,
      ffnDim: config.ffnDim,
      dotAttention: body.filter((d) => d.pipeline.label.startsWith('attention-prefill-dot')).length,
    };
  } finally {
    engine.unload();
    await source.close?.();
  }
}

/** Top-1 agreement, perplexity ratio and worst |Δ log p| of `other`'s teacher-forced logits against `f32`'s. */
type Forced = Awaited<ReturnType<typeof forcedLogits>>;

function agreement(f32: Forced, other: Forced) {
  const { ids, vocab } = f32;
  let agree = 0;
  let nllF32 = 0;
  let nllOther = 0;
  let worst = 0;
  for (let t = 0; t + 1 < ids.length; t++) {
    const a = f32.logits.subarray(t * vocab, (t + 1) * vocab);
    const b = other.logits.subarray(t * vocab, (t + 1) * vocab);
    let argA = 0;
    let argB = 0;
    for (let v = 1; v < vocab; v++) {
      if (a[v] > a[argA]) argA = v;
      if (b[v] > b[argB]) argB = v;
    }
    if (argA === argB) agree++;
    const la = logProbability(f32.logits, t * vocab, vocab, ids[t + 1]);
    const lb = logProbability(other.logits, t * vocab, vocab, ids[t + 1]);
    nllF32 -= la;
    nllOther -= lb;
    worst = Math.max(worst, Math.abs(la - lb));
  }
  const scored = ids.length - 1;
  return { agree, scored, perplexityRatio: Math.exp((nllOther - nllF32) / scored), worst };
}

/**
 * Top-1 agreement with the f32 graph on >= 90% of the targets, perplexity within 2%, and no target's log-probability
 * moved by more than 0.25 nats; the figures go to stderr.
 */
function expectAgreement(what: string, f32: Forced, other: Forced): void {
  const r = agreement(f32, other);
  expect(r.agree / r.scored).toBeGreaterThanOrEqual(0.9);
  expect(Math.abs(r.perplexityRatio - 1)).toBeLessThan(0.02);
  expect(r.worst).toBeLessThan(0.25);
  process.stderr.write(
    `${what} vs f32: top-1 ${r.agree}/${r.scored}, perplexity ratio ${r.perplexityRatio.toFixed(5)}, worst |Δ log p| ${r.worst.toFixed(4)}\n`,
  );
}

describe('int8 prefill kernels in the forward pass (demo model, Q8_0)', () => {
  it('teacher-forced logits with the projections on dot4I8Packed agree with the f32 projections', async () => {
    const f32 = await forcedLogits({ prefillMatmul: 'f32', prefillAttention: 'f32' });
    const int8 = await forcedLogits({ prefillMatmul: 'int8-dot', prefillAttention: 'f32' });
    // The int8 graph quantizes each projection input (qkv, o, gate_up, down) of every layer; f32 none. The down
    // projection's quantizer computes silu(gate)·up itself: no swiglu pass, where f32 has one a layer.
    expect(f32.quantizes).toBe(0);
    expect(int8.quantizes).toBe(4 * f32.layers);
    expect([f32.swiglus, int8.swiglus]).toEqual([f32.layers, 0]);
    // So the hidden activations need room for a decode step's only (the f32 graph's 64-token chunks write them).
    expect([f32.hiddenBytes, int8.hiddenBytes]).toEqual([64 * f32.ffnDim * 4, f32.ffnDim * 4]);
    expect(f32.ids.length).toBeGreaterThan(60);
    expectAgreement('int8-dot matmuls', f32, int8);
  });

  it('teacher-forced logits with the prefill attention on dot4I8Packed agree with the f32 attention', async () => {
    const f32 = await forcedLogits({ prefillMatmul: 'f32', prefillAttention: 'f32' });
    const int8 = await forcedLogits({ prefillMatmul: 'f32', prefillAttention: 'int8-dot' });
    // Every layer's prefill attention runs the dot4I8Packed kernel; none with 'f32'.
    expect(f32.dotAttention).toBe(0);
    expect(int8.dotAttention).toBe(f32.layers);
    expectAgreement('int8-dot attention', f32, int8);
  });
});

describe('defaultPrefillChunk: the largest prefill step the int8 tensor-core path takes that the KV budget holds', () => {
  // Llama-3.2-1B's cache shape: an f16 page of 16 tokens is 512 KiB.
  const llama = { layers: 16, kvHeads: 8, headDim: 64 } as const;

  it('128 without tensor cores; with them 1024, or 512 or 128 when a 2-bit budget holds no larger step', () => {
    const f16 = { ...llama, budgetBytes: 64 << 20, kv: 'f16' as const };
    expect(defaultPrefillChunk(false, f16)).toBe(128);
    expect(defaultPrefillChunk(true, f16)).toBe(1024);
    expect(defaultPrefillChunk(true, { ...llama, budgetBytes: 1 << 30, kv: 'quant' })).toBe(1024);
    // The f16 share of a 2-bit pool is capped at half the budget: 160 MiB holds 512-token steps, not 1024.
    const quant = { ...llama, budgetBytes: 160 << 20, kv: 'quant' as const };
    expect([KvPagePool.holdsStep(quant, 512), KvPagePool.holdsStep(quant, 1024)]).toEqual([true, false]);
    expect(defaultPrefillChunk(true, quant)).toBe(512);
    expect(defaultPrefillChunk(true, { ...llama, budgetBytes: 64 << 20, kv: 'quant' })).toBe(128);
  });
});
