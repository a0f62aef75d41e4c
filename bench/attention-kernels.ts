/**
 * Same-machine comparison of the decode attention kernels over an f16 pool: the general split kernel
 * (attention.wgsl.ts) and the decode kernel (attention-decode.wgsl.ts, unrolled and with run-time loop bounds), at
 * one layer of a real model's shape and several context lengths. Each variant is checked against the CPU reference
 * first (at the shortest context), then timed: the dispatches of one layer's attention recorded n and 5n times into one
 * pass, (fastest of three 5n runs − fastest of three n runs) / 4n.
 *
 * With `--kv int2` the pool is in quant mode (sink 64, window 256, the runtime's INT2 formats): pages are filled
 * through the real append + demotion dispatches, and each decode-kernel variant is checked against the split kernel
 * (tested against the CPU reference on the same pages) instead of the reference.
 *
 * With `--prefill`, it times one prefill chunk (`--tokens` queries) at the end of each context instead (the
 * runtime's prefill split settings, or each count of `--splits`), the split kernel against the prefill kernel
 * (attention-prefill.wgsl.ts), the latter checked against the former on the same pages; f16 and int2 pools.
 *
 * Decode runs also time ablations of whole phases of the decode kernel (PHASE_ABLATIONS): where its time goes.
 *
 * With `--roofline`, the decode kernel against the bytes it must read: per shape (default llama-3.2-1b, hd64-g8,
 * qwen3-4b, hd128-g8: head sizes 64 and 128, groups 4 and 8), pool kind (`--kv f16,int2`, both by default) and
 * context (default 8K, 32K, 128K), one layer's K and V bytes as the pool holds them (bench/attention-roofline.ts),
 * the time they take at the copy bandwidth measured first (`--copy-mib 1024`), the decode kernel as the runtime plans
 * it (split pass + merge, checked, then each dispatch's median GPU time where the device has timestamps, else n/5n),
 * its share of that floor, and the phase and load ablations timed the same way. JSON with `--out`, a markdown table
 * on stdout.
 *
 * With `--prefill`, the int8 prefill kernels are timed too where the device runs them (attention-prefill-int8.wgsl.ts
 * on i8 subgroup matrices, attention-prefill-dot.wgsl.ts on dot4I8Packed), checked against the split kernel to
 * INT8_ATTENTION_QUANTIZATION_BOUND. `--check-int8` first runs the reference cases and broken kernels of
 * kernels/attention-prefill-int8.test.ts for both (CI's adapters skip the tensor-core ones). `--tokens` sets the
 * prefill chunk (128); `--kernels int8,int8-pages` times only those (the split kernel still runs as their reference,
 * untimed unless listed). Without `--prefill`, `--kernels decode,decode-sub128` times only those decode variants
 * (and the split kernel, the int2 runs' reference).
 *
 *   npx tsx bench/attention-kernels.ts [--kv f16|int2] [--kernels A,B] [--prefill [--splits N,M]] [--tokens 128]
 *                                      [--check-int8] [--ablate-int8]
 *                                      [--contexts 1024,8192,32768]
 *                                      [--shapes llama-3.2-1b,qwen2.5-0.5b,qwen3-4b] [--out FILE.json]
 *   npx tsx bench/attention-kernels.ts --roofline [--kv f16,int2] [--contexts 8192,32768,131072]
 *                                      [--shapes llama-3.2-1b,hd64-g8,qwen3-4b,hd128-g8] [--copy-mib 1024] [--reps 50]
 *                                      [--out FILE.json]
 * On the GPU host: bundled by `npm run bench:bundle` (.gpu/attention-kernels.mjs).
 */

import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { acquireGpu, type GpuContext } from '../core/gpu/device.ts';
import { type PreparedDispatch, releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { nodeGpu } from '../core/gpu/node.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import {
  type AttentionBinding,
  attentionDecodeShape,
  attentionPrefillDotShapeFor,
  attentionPrefillInt8ShapeFor,
  prepareAttention,
} from '../kernels/attention.ts';
import { attentionMergeSource } from '../kernels/attention.wgsl.ts';
import {
  attentionDecodePassKeys,
  attentionDecodeSource,
  type DecodeQuantShape,
} from '../kernels/attention-decode.wgsl.ts';
import { attentionPrefillDotShape } from '../kernels/attention-prefill-dot.wgsl.ts';
import {
  type AttentionPrefillInt8Shape,
  attentionKeysInt8Source,
  attentionPrefillInt8Shape,
  attentionPrefillInt8Source,
} from '../kernels/attention-prefill-int8.wgsl.ts';
import { prepareKvAppend } from '../kernels/kv-append.ts';
import { attentionReference } from '../kernels/reference/attention.ts';
import {
  decodeSplitsFor,
  PagedKvAttention,
  PREFILL_MIN_CHUNK_KEYS,
  prefillSplitsFor,
} from '../runtime/kv/paged-attention.ts';
import { KvPagePool, type KvSequence } from '../runtime/kv/pool.ts';
import {
  INT8_ATTENTION_QUANTIZATION_BOUND,
  INT8_ATTENTION_TOLERANCE,
  INT8_PREFILL_CASES,
  INT8_PREFILL_MUTATIONS,
  int8MutationRatio,
  runSteps,
} from '../test/attention-harness.ts';
import { type AttentionSources, withAttentionSources } from '../test/attention-sources.ts';
import { INT8_MIXED_CASES, runMixed } from '../test/mixed-attention-harness.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import {
  type CopyBandwidth,
  kvBytesRead,
  measureCopyBandwidth,
  ROOFLINE_DEFAULTS,
  ROOFLINE_SHAPES,
  type RooflineRow,
  rooflineMarkdown,
} from './attention-roofline.ts';
import { timeDispatches, timeEachDispatch } from './gpu-timing.ts';
import { LAYER_SHAPES, type LayerShape, layerShapesNamed, SHAPES_OPTION } from './models.ts';
import { edited } from './wgsl-edit.ts';

/** The decode graph's fewest keys per split (runtime/kv/paged-attention.ts; its splits: decodeSplitsFor). */
const MIN_CHUNK = 64;
const FILL_CHUNK = 512;

type Variant = {
  name: string;
  decodeKernel: boolean;
  /**
   * Replacement WGSL for a layer shape and the pool's quant formats (null: an f16 pool); null where the variant is
   * the build itself for that shape (skipped).
   */
  sources?: (s: LayerShape, quant: DecodeQuantShape | null) => AttentionSources | null;
  /** Splits at most (default: the runtime's, decodeSplitsFor). */
  splits?: number;
  /** An ablation: wrong results by design, timed only (where the decode kernel's time goes). */
  ablation?: boolean;
};
/** The decode build of the shape: as the runtime builds it (attentionDecodeShape: loops), or unrolled. */
const decodeSource = (s: LayerShape, quant: DecodeQuantShape | null, unrolled = false) => {
  const layer = { headDim: s.headDim, rows: s.heads / s.kvHeads, quant };
  return attentionDecodeSource({ ...layer, unrolled, passKeys: attentionDecodePassKeys(layer) });
};
/** The decode build of the shape with `edit` applied: an ablation. */
const decodeEdit = (edit: (code: string) => string) => (s: LayerShape, quant: DecodeQuantShape | null) => ({
  decode: edited(decodeSource(s, quant), edit),
});
/** An ablation of the decode kernel: its build with `edit` applied, timed only. */
const decodeAblation = (name: string, edit: (code: string) => string): Variant => ({
  name,
  decodeKernel: true,
  ablation: true,
  sources: decodeEdit(edit),
});
/** 128 keys a pass instead of 256: one key per invocation in phase A, twice the passes (same results). */
const DECODE_SUB128: Variant = {
  name: 'decode-sub128',
  decodeKernel: true,
  // Skipped where the build already takes 128 (more than 8 rows).
  sources: (s, quant) =>
    decodeSource(s, quant).includes('const SUB: u32 = 256u;')
      ? decodeEdit((c) => c.replace('const SUB: u32 = 256u;', 'const SUB: u32 = 128u;'))(s, quant)
      : null,
};
/** The decode build at other split counts than the runtime's (decodeSplitsFor). */
const SPLIT_VARIANTS: Variant[] = [128, 96, 192].map((splits) => ({
  name: `decode-${splits}splits`,
  decodeKernel: true,
  splits,
}));
/** DECODE_SUB128 at more splits: smaller workgroups (less workgroup memory) and more of them resident an SM. */
const decodeSub128Splits = (splits: number): Variant => ({
  ...DECODE_SUB128,
  name: `decode-sub128-${splits}splits`,
  splits,
});
/**
 * Split counts tried with the 128-key pass: more, smaller workgroups resident an SM (no gain on the H200:
 * bench/journal.md, session 21).
 */
const SUB128_SPLITS: Variant[] = [96, 128, 192, 256].map(decodeSub128Splits);
/** The decode build with its loops over a key's dims unrolled (the runtime keeps them as loops). */
const DECODE_UNROLLED: Variant = {
  name: 'decode-unrolled',
  decodeKernel: true,
  sources: (s, quant) => ({ decode: decodeSource(s, quant, true) }),
};
const VARIANTS: Variant[] = [
  { name: 'split', decodeKernel: false },
  { name: 'decode', decodeKernel: true },
  DECODE_UNROLLED,
  ...SPLIT_VARIANTS,
  DECODE_SUB128,
  ...SUB128_SPLITS,
  // Ablations: the value loads replaced by a constant; the key loads replaced by a constant; one slab bound.
  decodeAblation('abl-noV', (c) => c.replace(/let q4 = slabQuad\(slot, [^;]*\);/, 'let q4 = vec4<u32>(key);')),
  decodeAblation('abl-noK', (c) => c.replace('let w = slabQuad(slot, base + c);', 'let w = vec4<u32>(base + c);')),
  decodeAblation('abl-slab0', (c) =>
    c.replace(
      'if (slot == 0u) { w = slab0[i]; } else if (slot == 1u) { w = slab1[i]; } else if (slot == 2u) { w = slab2[i]; } else { w = slab3[i]; }',
      // slot is never 99: the other slabs stay bound, their branch never runs
      'w = slab0[i]; if (slot == 99u) { w = slab1[i] + slab2[i] + slab3[i]; }',
    ),
  ),
];

/** The merge pass (unrotated) with `edit` applied: an ablation. */
const mergeEdit = (edit: (code: string) => string) => () => ({ merge: edited(attentionMergeSource(false), edit) });

/**
 * Ablations of whole phases of the decode kernel (kernels/attention-decode.wgsl.ts): without phase A's
 * scores (every key keeps the empty score, so its weight is 0), without phase C's value loop, without the final sum
 * over key slices, without phase C's reads of the weights; and of the merge pass: returning at once (its bindings
 * stay in the code), without its weighted sum.
 */
const PHASE_ABLATIONS: Variant[] = [
  decodeAblation('abl-noA', (c) =>
    c.replace(/if \(j < n\) \{\n(\s+)let key = block \+ j;/, (m) =>
      m.replace('if (j < n) {', 'if (j < n && n == 0u) {'),
    ),
  ),
  decodeAblation('abl-noC', (c) => c.replace('for (var jb = slice; jb < n;', 'for (var jb = slice; jb < 0u;')),
  decodeAblation('abl-noCombine', (c) =>
    c.replace('for (var first = 1u; first < KS;', 'for (var first = 1u; first < 1u;'),
  ),
  {
    // Phase C's weights read from workgroup memory replaced by their key index: what those reads cost.
    name: 'abl-noPReads',
    decodeKernel: true,
    ablation: true,
    sources: decodeEdit((c) => c.replaceAll(/let p = sc\[j \* RG \+ (\d+)u\];/g, 'let p = vec4<f32>(f32(j));')),
  },
  {
    name: 'abl-noMerge',
    decodeKernel: true,
    ablation: true,
    sources: mergeEdit((c) => c.replace('if (t >= step.tokens) { return; }', 'if (t < 0xffffffffu) { return; }')),
  },
  {
    name: 'abl-noMergeSum',
    decodeKernel: true,
    ablation: true,
    // The partial sums' loads (early and late) replaced by their indices.
    sources: mergeEdit((c) => c.replaceAll(/partials\[at \+ ([^\]]+)\]/g, 'f32(at + $1)')),
  },
];

/** int2 pools: the kernels, and ablations of the decode kernel's quant paths. */
const QUANT_VARIANTS: Variant[] = [
  { name: 'split', decodeKernel: false },
  { name: 'decode', decodeKernel: true },
  ...SPLIT_VARIANTS,
  DECODE_SUB128,
  ...SUB128_SPLITS,
  DECODE_UNROLLED,
  // Other numbers of keys per value batch (registers held across the loads): same results, checked like the build.
  // A build whose own batch is that size (Qwen2.5-0.5B's two row groups take 4) skips it.
  ...[4, 2].map(
    (batch): Variant => ({
      name: `decode-batch${batch}`,
      decodeKernel: true,
      sources: (s, quant) => {
        const own = Number(/const BATCH: u32 = (\d+)u;/.exec(decodeSource(s, quant))?.[1]);
        if (own === batch) return null;
        return decodeEdit((c) =>
          c.replace(/const BATCH: u32 = \d+u;/, `const BATCH: u32 = ${batch}u;`).replace(
            /var vals: array<vec4<f32>, (\d+)>;/,
            // vec4s per key: the array's size over the build's own batch.
            (_, n) => `var vals: array<vec4<f32>, ${(Number(n) / own) * batch}>;`,
          ),
        )(s, quant);
      },
    }),
  ),
  // Ablations: quant value loads replaced by a constant; quant key code loads replaced by a constant.
  // (The V code words phase A stages for phase C, where 16-byte aligned as in the bench's pools.)
  decodeAblation('abl-noQuantV', (c) =>
    c.replace('let quad = slabQuad(slot, at / 4u + w / 4u);', 'let quad = vec4<u32>(at + w);'),
  ),
  decodeAblation('abl-noQuantK', (c) => c.replace('quad = slabQuad(slot, at / 4u);', 'quad = vec4<u32>(at);')),
  // Phase A on quant pages without the loop over a group's code words (their loads and products): what is left is
  // the page-table entry, the group's (lo, scale) load and the score's store.
  decodeAblation('abl-noQuantKDims', (c) =>
    c.replace('for (var wq = 0u; wq < (K_GE / K_PER / 4u) * one; wq++) {', 'for (var wq = 0u; wq < 0u; wq++) {'),
  ),
  // Phase A on quant pages without the group's (lo, scale) load.
  decodeAblation('abl-noQuantKLoHi', (c) =>
    c.replace(
      'let lohi = unpack2x16float(slabWord(slot, row + params.kCodeWords + e0 / K_GROUP));',
      'let lohi = vec2<f32>(f32(row & 7u), 1.0);',
    ),
  ),
  // Phase A's code words always loaded as one vec4 (wrong where a row is not 16-byte aligned: timing only).
  decodeAblation('abl-alignedK', (c) => c.replace('if ((at & 3u) == 0u) {', 'if (true) {')),
  // Phase A's reads of q from workgroup memory (a vec4 per dim and key) replaced by 8 registers loaded once, dim d
  // taking register d % 8: the products stay, their operand's loads go.
  decodeAblation('abl-noQReads', (c) =>
    c
      .replace(
        'let part = lid % TPK;',
        `let part = lid % TPK;\n${Array.from({ length: 8 }, (_, e) => `  let qr${e} = qt[${e}u * RG + lid % RG];`).join('\n')}`,
      )
      .replaceAll(/qt\[\([^()]*?(?: \+ (\d)u)?\) \* RG \+ \d+u\]/g, (_, e?: string) => `qr${e ?? 0}`),
  ),
];

/**
 * The decode variants a run times: all of `list` and the phase ablations, or (`--kernels`) those named, with the
 * split kernel first where the list has one (the int2 runs' reference).
 */
function decodeVariants(list: Variant[], only: string[] | undefined): Variant[] {
  const all = [...list, ...PHASE_ABLATIONS];
  if (!only) return all;
  const named = variantsNamed(all, only);
  const split = list.find((v) => v.name === 'split');
  return split && !only.includes('split') ? [split, ...named] : named;
}

/** Layer 0's attention for one decode step, as the runtime's decode graph binds it, with the variant's knobs. */
function decodeStepBinding(
  pool: AttentionBinding['pool'],
  shape: LayerShape,
  variant: Variant,
  q: GPUBuffer,
  output: GPUBuffer,
): AttentionBinding {
  return {
    pool,
    layer: 0,
    q,
    output,
    heads: shape.heads,
    maxTokens: 1,
    scale: 1 / Math.sqrt(shape.headDim),
    splits: variant.splits ?? decodeSplitsFor(shape.kvHeads),
    minChunkKeys: MIN_CHUNK,
    decodeKernel: variant.decodeKernel,
  };
}

/** Appends FILL_CHUNK-token blocks (through `append`: the runtime's append, + demotion in a quant pool) up to `context`. */
function fillTo(gpu: GpuContext, pool: KvPagePool, seq: KvSequence, context: number, append: PreparedDispatch[]): void {
  while (seq.length + FILL_CHUNK <= context) {
    pool.writeStep(seq, seq.length, FILL_CHUNK);
    pool.submitPending(); // page copies and promotions the step asked for
    submitDispatches(gpu, 'fill', append);
  }
}

/** One layer's pool (f16 or quant mode) and its buffers, with random q and a FILL_CHUNK-token block of k, v uploaded. */
function layerSetup(gpu: GpuContext, shape: LayerShape, contexts: number[], kv: 'f16' | 'quant') {
  const { heads, kvHeads, headDim } = shape;
  const pool = new KvPagePool(gpu, {
    layers: 1,
    kvHeads,
    headDim,
    pageTokens: 16,
    kv,
    budgetBytes: (Math.max(...contexts) + FILL_CHUNK) * kvHeads * headDim * 4 + (16 << 20),
    maxSequences: 1,
  });
  const buffer = (floats: number) => gpu.allocator.createStorage('bench', 'scratch', floats * 4);
  const buffers = {
    q: buffer(heads * headDim),
    k: buffer(FILL_CHUNK * kvHeads * headDim),
    v: buffer(FILL_CHUNK * kvHeads * headDim),
    output: buffer(heads * headDim),
  };
  const random = seededRandom(kv === 'f16' ? 1 : 2);
  const data = {
    q: randomFloats(random, heads * headDim, 2),
    k: randomFloats(random, FILL_CHUNK * kvHeads * headDim, 2),
    v: randomFloats(random, FILL_CHUNK * kvHeads * headDim, 1),
  };
  for (const name of ['q', 'k', 'v'] as const) {
    gpu.device.queue.writeBuffer(buffers[name], 0, data[name].buffer, data[name].byteOffset, data[name].byteLength);
  }
  const release = () => {
    pool.destroy();
    for (const b of Object.values(buffers)) gpu.allocator.release(b);
  };
  return { pool, ...buffers, data, release };
}

/**
 * The tolerance ratio of a decode step's output over an f16 pool filled by fillTo (the same FILL_CHUNK random keys and
 * values over and over) against the CPU reference: ≤ 1 passes.
 */
function f16ReferenceRatio(
  actual: Float32Array,
  shape: LayerShape,
  data: { q: Float32Array; k: Float32Array; v: Float32Array },
  context: number,
): number {
  const { heads, kvHeads, headDim } = shape;
  const repeat = (block: Float32Array) => {
    const all = new Float32Array(context * kvHeads * headDim);
    for (let t = 0; t < context; t += FILL_CHUNK)
      all.set(block.subarray(0, (context - t) * kvHeads * headDim), t * kvHeads * headDim);
    return all;
  };
  const expected = attentionReference({
    q: data.q,
    k: repeat(data.k),
    v: repeat(data.v),
    position: context - 1,
    tokens: 1,
    heads,
    kvHeads,
    headDim,
    scale: 1 / Math.sqrt(headDim),
  });
  return maxToleranceRatio(actual, expected, 2e-5, 2e-4);
}

async function benchShape(gpu: GpuContext, shape: LayerShape, contexts: number[], only?: string[]) {
  const { heads, kvHeads, headDim } = shape;
  const { pool, q, k, v, output, data, release } = layerSetup(gpu, shape, contexts, 'f16');
  const fill = [prepareKvAppend(gpu, 'fill', { pool, layer: 0, k, v, tokens: FILL_CHUNK })];
  const seq = pool.createSequence();
  const rows: Record<string, unknown>[] = [];
  for (const context of contexts) {
    // The cache holds the same 512 random keys over and over: the reference repeats them too.
    fillTo(gpu, pool, seq, context, fill);
    pool.writeStep(seq, context - 1, 1);
    pool.submitPending(); // page copies and promotions the step asked for
    const row: Record<string, unknown> = { shape: shape.name, context };
    for (const variant of decodeVariants(VARIANTS, only)) {
      const sources = variant.sources?.(shape, null);
      if (sources === null) continue;
      const binding = decodeStepBinding(pool, shape, variant, q, output);
      const dispatches = prepareAttention(withAttentionSources(gpu, sources), variant.name, binding);
      if (context === Math.min(...contexts) && !variant.ablation) {
        submitDispatches(gpu, 'check', dispatches);
        const actual = await readFloat32(gpu, output, heads * headDim);
        row[`${variant.name}ToleranceRatio`] = f16ReferenceRatio(actual, shape, data, context);
      }
      const ms = await timeDispatches(gpu, dispatches, 50);
      row[`${variant.name}Us`] = Math.round(ms * 10000) / 10;
      row[`${variant.name}GBs`] = Math.round((context * kvHeads * headDim * 4) / (ms * 1e-3) / 1e9);
      releaseDispatches(gpu, dispatches);
    }
    console.log(JSON.stringify(row));
    rows.push(row);
  }
  releaseDispatches(gpu, fill);
  release();
  gpu.throwIfErrors();
  return rows;
}

async function benchQuantShape(gpu: GpuContext, shape: LayerShape, contexts: number[], only?: string[]) {
  const { heads, headDim } = shape;
  const { pool, q, k, v, output, release } = layerSetup(gpu, shape, contexts, 'quant');
  // The formats the runtime's decode build reads, as prepareAttention derives them.
  const quant = attentionDecodeShape(gpu, { pool, layer: 0, heads, maxTokens: 1 })?.quant;
  if (!quant) throw new Error(`the decode kernel does not serve ${shape.name} on an int2 pool`);
  const reference = gpu.allocator.createStorage('bench', 'scratch', heads * headDim * 4);
  // The runtime's own append + demotion for prefill chunks of FILL_CHUNK tokens.
  const fill = new PagedKvAttention(gpu, pool, { heads }).prepareLayer(0, { q, k, v, output }, FILL_CHUNK, null);
  const seq = pool.createSequence();
  const rows: Record<string, unknown>[] = [];
  for (const context of contexts) {
    fillTo(gpu, pool, seq, context, fill.append);
    pool.writeStep(seq, context - 1, 1);
    pool.submitPending(); // page copies and promotions the step asked for
    // The step's own append + demotion, so every page the planned demotions switched holds what it says.
    submitDispatches(gpu, 'fill', fill.append);
    const row: Record<string, unknown> = { shape: shape.name, kv: 'int2', context, quantPages: pool.stats() };
    let expected: Float32Array | null = null;
    for (const variant of decodeVariants(QUANT_VARIANTS, only)) {
      const sources = variant.sources?.(shape, quant);
      if (sources === null) continue;
      const binding = decodeStepBinding(pool, shape, variant, q, variant.decodeKernel ? output : reference);
      const dispatches = prepareAttention(withAttentionSources(gpu, sources), variant.name, binding);
      if (!variant.ablation) {
        submitDispatches(gpu, 'check', dispatches);
        const actual = await readFloat32(gpu, binding.output, heads * headDim);
        if (!variant.decodeKernel) expected = actual;
        else if (expected) row[`${variant.name}ToleranceRatio`] = maxToleranceRatio(actual, expected, 2e-5, 2e-4);
      }
      const ms = await timeDispatches(gpu, dispatches, 50);
      row[`${variant.name}Us`] = Math.round(ms * 10000) / 10;
      releaseDispatches(gpu, dispatches);
    }
    console.log(JSON.stringify(row));
    rows.push(row);
  }
  releaseDispatches(gpu, [...fill.append, ...fill.attention]);
  gpu.allocator.release(reference);
  release();
  gpu.throwIfErrors();
  return rows;
}

/** The variants of `list` named `names`, in that order (each must exist). */
function variantsNamed(list: Variant[], names: string[]): Variant[] {
  return names.map((name) => {
    const found = list.find((v) => v.name === name);
    if (!found) throw new Error(`no variant ${name}`);
    return found;
  });
}

/** The roofline's ablations: the decode kernel's phases, and the loads of the pool kind's pages. */
const ROOFLINE_ABLATIONS: Record<'f16' | 'int2', Variant[]> = {
  f16: [...PHASE_ABLATIONS, ...variantsNamed(VARIANTS, ['abl-noK', 'abl-noV'])],
  int2: [...PHASE_ABLATIONS, ...variantsNamed(QUANT_VARIANTS, ['abl-noQuantK', 'abl-noQuantV', 'abl-noQuantKDims'])],
};

/** µs rounded to 0.1. */
const us = (ms: number) => Math.round(ms * 10000) / 10;

/**
 * One layer's dispatches timed as the roofline times them: each dispatch's median GPU time (its own pass, timestamp
 * writes), summed, where the device has timestamps; else the n/5n wall clock of them in one pass (timeDispatches).
 */
async function timeLayer(gpu: GpuContext, dispatches: PreparedDispatch[], reps: number) {
  if (!gpu.features.timestampQuery) return { us: us(await timeDispatches(gpu, dispatches, reps)) };
  const each = await timeEachDispatch(gpu, dispatches, reps);
  return {
    us: us(each.reduce((a, b) => a + b, 0)),
    dispatchUs: Object.fromEntries(dispatches.map((d, i) => [d.label, us(each[i])])),
  };
}

/**
 * The roofline of one shape's decode attention over one kind of pool, per context: the K and V bytes the step reads
 * (kvBytesRead), their time at the copy bandwidth, and the decode kernel as the runtime plans it (split pass + merge,
 * checked first: against the CPU reference at the shortest context on f16, against the split kernel at every context
 * on int2) with its ablations, timed by timeLayer.
 */
async function benchRoofline(
  gpu: GpuContext,
  shape: LayerShape,
  contexts: number[],
  kind: 'f16' | 'int2',
  copy: CopyBandwidth,
  /** Runs per timing (timeEachDispatch's rounds, timeDispatches' n). */
  reps: number,
): Promise<RooflineRow[]> {
  const { heads, headDim } = shape;
  const { pool, q, k, v, output, data, release } = layerSetup(gpu, shape, contexts, kind === 'f16' ? 'f16' : 'quant');
  const decode: Variant = { name: 'decode', decodeKernel: true };
  const built = attentionDecodeShape(gpu, { pool, layer: 0, heads, maxTokens: 1, decodeKernel: true });
  if (!built) throw new Error(`the decode kernel does not serve ${shape.name} on an ${kind} pool`);
  const kvAttention = new PagedKvAttention(gpu, pool, { heads });
  // The harness binds the decode step itself (decodeStepBinding, so that ablations can swap its code): it must be the
  // step the runtime's decode graph plans.
  const plan = kvAttention.plan(0, 1);
  const binding = decodeStepBinding(pool, shape, decode, q, output);
  if (plan.kernel.kernel !== 'decode' || plan.splits !== binding.splits || plan.minChunkKeys !== MIN_CHUNK) {
    throw new Error(
      `the runtime plans ${shape.name}'s decode step as ${plan.kernel.kernel}, ${plan.splits} splits of at least ${plan.minChunkKeys} keys; decodeStepBinding differs`,
    );
  }
  const reference = gpu.allocator.createStorage('bench', 'scratch', heads * headDim * 4);
  // The runtime's own append (+ demotion in a quant pool) for prefill chunks of FILL_CHUNK tokens.
  const fill = kvAttention.prepareLayer(0, { q, k, v, output }, FILL_CHUNK, null);
  const seq = pool.createSequence();
  const rows: RooflineRow[] = [];
  for (const context of contexts) {
    fillTo(gpu, pool, seq, context, fill.append);
    pool.writeStep(seq, context - 1, 1);
    pool.submitPending(); // page copies and promotions the step asked for
    // int2: the step's own append + demotion, so every page the planned demotions switched holds what it says. (An
    // f16 pool keeps the repeated block the CPU reference rebuilds.)
    if (kind === 'int2') submitDispatches(gpu, 'fill', fill.append);
    const read = kvBytesRead(pool, seq, context);
    const dispatches = prepareAttention(gpu, 'decode', binding);
    let toleranceRatio: number | undefined;
    if (kind === 'int2' || context === Math.min(...contexts)) {
      submitDispatches(gpu, 'check', dispatches);
      const actual = await readFloat32(gpu, output, heads * headDim);
      if (kind === 'f16') toleranceRatio = f16ReferenceRatio(actual, shape, data, context);
      else {
        const split = { name: 'split', decodeKernel: false };
        const splitDispatches = prepareAttention(gpu, 'split', decodeStepBinding(pool, shape, split, q, reference));
        submitDispatches(gpu, 'check', splitDispatches);
        const expected = await readFloat32(gpu, reference, heads * headDim);
        releaseDispatches(gpu, splitDispatches);
        toleranceRatio = maxToleranceRatio(actual, expected, 2e-5, 2e-4);
      }
      if (toleranceRatio > 1) process.exitCode = 1;
    }
    const kernel = await timeLayer(gpu, dispatches, reps);
    const kernelWallUs = us(await timeDispatches(gpu, dispatches, reps));
    releaseDispatches(gpu, dispatches);
    const ablationUs: Record<string, number> = {};
    for (const variant of ROOFLINE_ABLATIONS[kind]) {
      const sources = variant.sources?.(shape, built.quant);
      if (sources === null) continue;
      const ablated = prepareAttention(
        withAttentionSources(gpu, sources),
        variant.name,
        decodeStepBinding(pool, shape, variant, q, reference),
      );
      ablationUs[variant.name] = (await timeLayer(gpu, ablated, reps)).us;
      releaseDispatches(gpu, ablated);
    }
    const floorUs = Math.round((read.bytes / (copy.gbs * 1e9)) * 1e7) / 10;
    const row: RooflineRow = {
      shape: shape.name,
      heads,
      kvHeads: shape.kvHeads,
      headDim,
      kind,
      context,
      read,
      floorUs,
      kernelUs: kernel.us,
      kernelMethod: gpu.features.timestampQuery ? 'gpu-timestamps' : 'n/5n wall clock',
      ...(kernel.dispatchUs ? { dispatchUs: kernel.dispatchUs } : {}),
      kernelWallUs,
      percentOfFloor: Math.round((1000 * floorUs) / kernel.us) / 10,
      ...(toleranceRatio !== undefined ? { toleranceRatio } : {}),
      ablationUs,
    };
    console.log(JSON.stringify(row));
    rows.push(row);
  }
  releaseDispatches(gpu, [...fill.append, ...fill.attention]);
  gpu.allocator.release(reference);
  release();
  gpu.throwIfErrors();
  return rows;
}

/** Phases of the int8 prefill kernel cut out (wrong results, timed only): where its time goes. */
const INT8_PREFILL_ABLATIONS: [string, (code: string) => string][] = [
  // The scores' reads and exponentials (the rest of the softmax stays).
  [
    'no-score-reads-exp',
    (code) => code.replaceAll(/f32\(sums\[r \* SP \+ [^\]]+\]\)/g, '1.0').replaceAll('exp(s', '(s'),
  ],
  // The copies of each tile's codes into workgroup memory (and so their loads).
  ['no-code-copies', (code) => code.replaceAll(/[kv]codes\[word \+ \du\] = ahead\[\d+\]\[\d\];/g, '')],
  // The barriers of the tile loop (racy: timing only).
  [
    'no-tile-barriers',
    (code) => {
      const at = code.indexOf('for (var block = tileStart;');
      return code.slice(0, at) + code.slice(at).replaceAll('workgroupBarrier();', '');
    },
  ],
  ['no-scores', (code) => code.replaceAll(/subgroupMatrixStore<row_major>\(&sums, sg \* 16u \* SP[^;]*;/g, '')],
  ['no-values', (code) => code.replaceAll(/subgroupMatrixStore<row_major>\(&sums, \(sg \* \du[^;]*;/g, '')],
  // The apply of P·V to the accumulators of one row in 8.
  ['no-apply', (code) => code.replaceAll(/\n\s*acc\[\d+\] = acc\[\d+\] \* rowCorr[1-7][^\n]*/g, '')],
  // Both products gone (their stores, so the compiler drops them): what the staging, softmax and apply cost alone.
  [
    'no-products',
    (code) =>
      code
        .replaceAll(/subgroupMatrixStore<row_major>\(&sums, sg \* 16u \* SP[^;]*;/g, '')
        .replaceAll(/subgroupMatrixStore<row_major>\(&sums, \(sg \* \du[^;]*;/g, ''),
  ],
  // The whole softmax block (scores to codes) gone: the products, staging and apply alone. (The converted build reads
  // its scores before the block, into values only the block uses.)
  [
    'no-softmax',
    (code) =>
      code.replace(
        /\n {4}\{\n {6}(let dq = qscale\[r\];|var tileMax)[\s\S]*?\n {4}\}\n {4}workgroupBarrier\(\);/,
        '\n    workgroupBarrier();',
      ),
  ],
  // Workgroup memory padded to the adapter's 48 KiB: one workgroup an SM on the H200, where WebGPU gets about 48 KiB
  // of workgroup memory an SM (bench/occupancy-probe.ts). Session 19's 42.5 KiB build ran as fast padded (it already
  // ran one an SM); the converted build's 24 KiB runs two.
  [
    'pad-48k',
    (code) => {
      const declared = [...code.matchAll(/var<workgroup> \w+: array<(i32|f32|vec4<f32>), (\d+)>;/g)].reduce(
        (words, m) => words + Number(m[2]) * (m[1] === 'vec4<f32>' ? 4 : 1),
        0,
      );
      const pad = 49152 / 4 - declared;
      return code
        .replace('var<workgroup> kcodes', `var<workgroup> occupancyPad: array<i32, ${pad}>;\nvar<workgroup> kcodes`)
        .replace(
          'let half = lane % 2u;',
          'let half = lane % 2u;\n  if (step.tokens == 0xffffffffu) { occupancyPad[li] = 1; }',
        );
    },
  ],
  // Not an ablation of time but a probe of occupancy: the output's first words count the workgroups running at once
  // (atomics; the outputs are not written), word 1 the most seen: on an SM's share, its resident workgroups.
  [
    'probe-resident',
    (code) =>
      code
        .replace('var<storage, read_write> dst: array<f32>;', 'var<storage, read_write> dst: array<atomic<u32>>;')
        .replaceAll(/\n\s*dst\[[^\n]*/g, '')
        .replace(
          'let half = lane % 2u;',
          'let half = lane % 2u;\n  if (li == 0u) { let now = atomicAdd(&dst[0], 1u) + 1u; atomicMax(&dst[1], now); }',
        )
        .replace(
          '\n  workgroupBarrier();\n  if (half == 0u) {\n    wscale[r] = l;',
          '\n  if (li == 0u) { atomicSub(&dst[0], 1u); }\n  workgroupBarrier();\n  if (half == 0u) {\n    wscale[r] = l;',
        ),
  ],
  // Every workgroup array shrunk to a quarter (out-of-range indices are clamped, so results are wrong but the work the
  // same): whether more workgroups an SM (less workgroup memory each) make the kernel faster.
  [
    'smem-quarter',
    (code) =>
      code.replaceAll(
        /var<workgroup> (\w+): array<(i32|f32|vec4<f32>), (\d+)>;/g,
        (_m, name, type, words) => `var<workgroup> ${name}: array<${type}, ${Math.ceil(Number(words) / 4)}>;`,
      ),
  ],
];

/**
 * Ablations of the int8 keys conversion pass (attentionKeysInt8Source), timed with the converted build after it: what
 * the pass costs (skipped: the attention reads the codes an earlier run left), and its transposition of V's tiles.
 */
const INT8_CONVERSION_ABLATIONS: [string, (code: string) => string][] = [
  [
    'conversion-skipped',
    (code) => code.replace('let kvh = wg.y;', 'let kvh = wg.y;\n  if (step.length > 0u) { return; }'),
  ],
  ['conversion-no-transpose', (code) => code.replace('keys8[vTileWord + w] = bitcast<i32>(word);', '')],
];

/**
 * Candidate changes to the int8 prefill kernel, as edits of its source: same results, so they are checked against the
 * split kernel like the kernels themselves, and timed next to them.
 */
const INT8_PREFILL_VARIANTS: [string, (code: string, shape: AttentionPrefillInt8Shape) => string][] = [
  // bench/journal.md keeps the variants tried (e.g. P·V tiles stored 20 words apart, the sums made floats by adding
  // 1.5·2^23, each tile's codes loaded where they are copied, rows of S 68 words apart, 8 subgroups a workgroup), with
  // their numbers.
];

/** The int8 build a binding takes, edited: ablations (timed only) and variants (checked too), named `int8-<name>`. */
function int8Edits(
  gpu: GpuContext,
  pool: KvPagePool,
  tokens: number,
  edits: [string, (code: string, shape: AttentionPrefillInt8Shape) => string][],
  of: 'attention' | 'conversion' = 'attention',
): [string, Partial<AttentionBinding>, AttentionSources][] {
  const built = attentionPrefillInt8ShapeFor(gpu, { pool, layer: 0, maxTokens: tokens, prefillProducts: 'int8' });
  if (!built || (of === 'conversion' && !built.converted)) return [];
  const code =
    of === 'attention' ? attentionPrefillInt8Source(built) : attentionKeysInt8Source(built.headDim, built.quant);
  return edits.map(([name, edit]) => {
    const source = edited(code, (c) => edit(c, built), `int8 edit '${name}'`);
    return [
      `int8-${name}`,
      { prefillProducts: 'int8' },
      of === 'attention' ? { prefillInt8: source } : { keysInt8: source },
    ];
  });
}

/**
 * One layer's attention for a prefill chunk of `tokens` queries ending at each context, over pages filled by the
 * runtime's append (+ demotion for int2): the split kernel, then the prefill kernel checked against it. TFLOPS counts
 * the causal products (q·k and p·v) the chunk needs.
 */
async function benchPrefillShape(
  gpu: GpuContext,
  shape: LayerShape,
  contexts: number[],
  kv: 'f16' | 'quant',
  tokens: number,
  ablate: boolean,
  /** Prefill splits of every kernel; default the runtime's (prefillSplitsFor: fewer for the tensor-core int8 kernel). */
  splits: number | undefined,
  /** Kernels to time, by name (the split kernel, the reference, always runs); default all. */
  only: string[] | undefined,
) {
  const { heads, headDim } = shape;
  const { pool, k, v, release } = layerSetup(gpu, shape, contexts, kv);
  const buffer = (floats: number) => gpu.allocator.createStorage('bench', 'scratch', floats * 4);
  const q = buffer(tokens * heads * headDim);
  const outputs = [0, 1, 2].map(() => buffer(tokens * heads * headDim));
  const qs = randomFloats(seededRandom(3), tokens * heads * headDim, 2);
  gpu.device.queue.writeBuffer(q, 0, qs.buffer, qs.byteOffset, qs.byteLength);
  const fill = new PagedKvAttention(gpu, pool, { heads }).prepareLayer(
    0,
    { q, k, v, output: outputs[0] },
    FILL_CHUNK,
    null,
  );
  const seq = pool.createSequence();
  const rows: Record<string, unknown>[] = [];
  for (const context of contexts) {
    fillTo(gpu, pool, seq, context, fill.append);
    const position = context - tokens;
    pool.writeStep(seq, position, tokens);
    pool.submitPending(); // page copies and promotions the step asked for
    // The chunk's append (+ demotion): in a quant pool the step plans demotions, which switch page-table entries.
    submitDispatches(gpu, 'fill', fill.append);
    const keysSeen = tokens * position + (tokens * (tokens + 1)) / 2;
    const flops = 4 * heads * headDim * keysSeen;
    const row: Record<string, unknown> = {
      shape: shape.name,
      kv: kv === 'f16' ? 'f16' : 'int2',
      context,
      splits: splits ?? 'prefillSplitsFor',
    };
    let expected: Float32Array | null = null;
    // The split kernel first, then the prefill kernels, checked against it: the f32 one to f32 rounding, the int8 ones
    // (where the device runs them) to INT8_ATTENTION_QUANTIZATION_BOUND, with their largest difference.
    const int8 =
      attentionPrefillInt8ShapeFor(gpu, { pool, layer: 0, maxTokens: tokens, prefillProducts: 'int8' }) !== null;
    const dot =
      attentionPrefillDotShapeFor(gpu, { pool, layer: 0, maxTokens: tokens, prefillProducts: 'int8-dot' }) !== null;
    const all: [string, Partial<AttentionBinding>, AttentionSources?][] = [
      ['split', { prefillKernel: false }],
      ['prefill', {}],
      // 'int8' converts the keys in a pass of its own where the buffer fits; 'int8-pages' converts each tile itself.
      ...(int8
        ? ([
            ['int8', { prefillProducts: 'int8' }],
            ['int8-pages', { prefillProducts: 'int8', convertKeys: false }],
          ] as [string, Partial<AttentionBinding>][])
        : []),
      ...(dot ? [['int8-dot', { prefillProducts: 'int8-dot' }] as [string, Partial<AttentionBinding>]] : []),
      ...(int8 ? int8Edits(gpu, pool, tokens, INT8_PREFILL_VARIANTS) : []),
      ...(int8 && ablate ? int8Edits(gpu, pool, tokens, INT8_PREFILL_ABLATIONS) : []),
      ...(int8 && ablate ? int8Edits(gpu, pool, tokens, INT8_CONVERSION_ABLATIONS, 'conversion') : []),
    ];
    const unknown = only?.filter((name) => !all.some(([known]) => known === name)) ?? [];
    if (unknown.length) {
      throw new Error(
        `--kernels: no kernel ${unknown.join(', ')} here; known: ${all.map(([name]) => name).join(', ')}`,
      );
    }
    // The split kernel (the first) is the others' reference: it always runs.
    const kernels = only ? all.filter(([name], i) => i === 0 || only.includes(name)) : all;
    const ablations = new Set(
      [...INT8_PREFILL_ABLATIONS, ...INT8_CONVERSION_ABLATIONS].map(([name]) => `int8-${name}`),
    );
    for (const [i, [name, knobs, sources]] of kernels.entries()) {
      const binding: AttentionBinding = {
        pool,
        layer: 0,
        q,
        output: outputs[Math.min(i, outputs.length - 1)],
        heads,
        maxTokens: tokens,
        scale: 1 / Math.sqrt(headDim),
        // --splits: that many for every step; else the runtime's settings (fewer splits for a long int8 step). The
        // occupancy probe counts in the output, which a graph of one split writes directly.
        ...(name.startsWith('int8-probe')
          ? { splits: 1, splitRows: 0 }
          : splits !== undefined
            ? { splits, splitRows: 0 }
            : prefillSplitsFor(knobs.prefillProducts === 'int8')),
        minChunkKeys: PREFILL_MIN_CHUNK_KEYS,
        ...knobs,
      };
      const dispatches = prepareAttention(withAttentionSources(gpu, sources), name, binding);
      // The occupancy probe's counters start at 0.
      if (name.startsWith('int8-probe')) gpu.device.queue.writeBuffer(binding.output, 0, new Uint32Array(2));
      submitDispatches(gpu, 'check', dispatches);
      const actual = await readFloat32(gpu, binding.output, tokens * heads * headDim);
      if (name.startsWith('int8-probe')) {
        row[`${name}Count`] = new Uint32Array(actual.buffer, actual.byteOffset, 2)[1];
      } else if (ablations.has(name)) {
        // Timed only.
      } else if (!expected) expected = actual;
      else if (name.startsWith('int8')) {
        const { atol, rtol } = INT8_ATTENTION_QUANTIZATION_BOUND;
        const ratio = maxToleranceRatio(actual, expected, atol, rtol);
        row[`${name}ToleranceRatio`] = ratio;
        row[`${name}MaxAbsDifference`] = maxToleranceRatio(actual, expected, 1, 0);
        if (ratio > 1) process.exitCode = 1;
      } else row[`${name}ToleranceRatio`] = maxToleranceRatio(actual, expected, 2e-5, 2e-4);
      // With --kernels, the reference is timed only when listed: at 1024 queries and 32K keys one f32 run takes 0.4 s
      // for Qwen3-4B, and a sweep of split counts spent its call timing it.
      if (!only || only.includes(name)) {
        const ms = await timeDispatches(gpu, dispatches, context > 8192 ? 3 : 10);
        row[`${name}Us`] = Math.round(ms * 10000) / 10;
        row[`${name}TFLOPS`] = Math.round(flops / (ms * 1e-3) / 1e10) / 100;
      }
      releaseDispatches(gpu, dispatches);
    }
    console.log(JSON.stringify(row));
    rows.push(row);
  }
  releaseDispatches(gpu, [...fill.append, ...fill.attention]);
  for (const b of [q, ...outputs]) gpu.allocator.release(b);
  release();
  gpu.throwIfErrors();
  return rows;
}

const { values } = parseArgs({
  options: {
    contexts: { type: 'string' },
    kv: { type: 'string' },
    prefill: { type: 'boolean', default: false },
    roofline: { type: 'boolean', default: false },
    'copy-mib': { type: 'string', default: '1024' },
    reps: { type: 'string', default: '50' },
    // Defaults by mode: SHAPES_OPTION's, or ROOFLINE_DEFAULTS'.
    shapes: { type: 'string' },
    out: { type: 'string' },
    tokens: { type: 'string', default: '128' },
    'check-int8': { type: 'boolean', default: false },
    'ablate-int8': { type: 'boolean', default: false },
    splits: { type: 'string' },
    kernels: { type: 'string' },
  },
});
// --splits takes a list: each count is a run of its own (its rows carry `splits`).
const prefillSplitCounts: (number | undefined)[] =
  values.splits === undefined ? [undefined] : values.splits.split(',').map(Number);
for (const count of prefillSplitCounts) {
  if (count !== undefined && !(Number.isInteger(count) && count >= 1)) {
    throw new Error(`--splits: whole numbers of at least 1, got ${values.splits}`);
  }
}
const onlyKernels = values.kernels?.split(',');
if (onlyKernels && values.roofline) throw new Error('--kernels picks prefill or decode kernels, not roofline ones');
const kinds = (values.kv ?? (values.roofline ? 'f16,int2' : 'f16')).split(',');
if (kinds.some((kind) => kind !== 'f16' && kind !== 'int2') || (kinds.length > 1 && !values.roofline)) {
  throw new Error(`--kv f16|int2${values.roofline ? ' (or both: f16,int2)' : ''}, got ${values.kv}`);
}
const kv = kinds[0] as 'f16' | 'int2';
const contexts = (values.contexts ?? (values.roofline ? ROOFLINE_DEFAULTS.contexts : '1024,8192,32768'))
  .split(',')
  .map(Number);
const shapesArg = values.shapes ?? (values.roofline ? ROOFLINE_DEFAULTS.shapes : SHAPES_OPTION.default);
const gpu = await acquireGpu({ gpu: await nodeGpu() });
console.log(JSON.stringify({ adapter: gpu.adapter }));
const results: Record<string, unknown>[] = [];
if (values.roofline) {
  const known = [...LAYER_SHAPES, ...ROOFLINE_SHAPES];
  const shapes = shapesArg.split(',').map((name) => {
    const shape = known.find((s) => s.name === name);
    if (!shape) throw new Error(`--shapes: no shape ${name}; known: ${known.map((s) => s.name).join(', ')}`);
    return shape;
  });
  if (contexts.some((c) => !(c > 0 && c % FILL_CHUNK === 0))) {
    throw new Error(`--contexts: multiples of ${FILL_CHUNK} (the fill's chunk), got ${contexts.join(',')}`);
  }
  const copy = await measureCopyBandwidth(gpu, Number(values['copy-mib']) * 2 ** 20);
  console.log(JSON.stringify({ copy }));
  const rows: RooflineRow[] = [];
  for (const shape of shapes) {
    for (const kind of kinds as ('f16' | 'int2')[]) {
      rows.push(...(await benchRoofline(gpu, shape, contexts, kind, copy, Number(values.reps))));
      // Written after every shape and kind: a call cut short keeps what it measured.
      if (values.out) {
        const report = {
          adapter: gpu.adapter,
          commit: process.env.LONGTAB_BENCH_COMMIT ?? null,
          roofline: true,
          copy,
          splits: 'decodeSplitsFor(kvHeads)',
          minChunk: MIN_CHUNK,
          reps: Number(values.reps),
          results: rows,
        };
        writeFileSync(values.out, `${JSON.stringify(report, null, 1)}\n`);
      }
    }
  }
  console.log(`\n${rooflineMarkdown(rows, copy)}`);
  gpu.destroy();
  process.exit(process.exitCode ?? 0);
}
if (values['check-int8']) {
  // The cases of kernels/attention-prefill-int8.test.ts for both int8 kernels, where this device runs them (CI's
  // adapters skip the tensor-core one).
  for (const products of ['int8', 'int8-dot'] as const) {
    const served = (headDim: number) =>
      products === 'int8'
        ? gpu.features.subgroupMatrixI8 &&
          attentionPrefillInt8Shape(headDim, null, gpu.limits.maxComputeWorkgroupStorageSize)
        : gpu.features.subgroups && attentionPrefillDotShape(headDim, null, gpu.limits.maxComputeWorkgroupStorageSize);
    const report = (check: string, ratio: number, pass: boolean) => {
      console.log(`${pass ? 'ok  ' : 'FAIL'} ${products} prefill ${check}: tolerance ratio ${ratio.toFixed(3)}`);
      results.push({ products, check, ratio, pass });
      if (!pass) process.exitCode = 1;
    };
    // The tensor-core kernel's build that converts each tile from the pages (where the int8 keys buffer would not
    // fit a binding) too.
    for (const convertKeys of products === 'int8' ? [true, false] : [true]) {
      for (const [name, shape, chunks, more] of INT8_PREFILL_CASES) {
        if (!served(shape.headDim)) continue;
        const { ratios } = await runSteps(gpu, shape, chunks, 57 + shape.headDim, 4, {
          ...more,
          prefillProducts: products,
          convertKeys,
          tolerance: INT8_ATTENTION_TOLERANCE,
        });
        report(`${name}${convertKeys ? '' : ', tiles from the pages'}`, Math.max(...ratios), Math.max(...ratios) <= 1);
      }
    }
    // A broken converted build at head size 128 (the second half of V's dims never staged: its P·V rounds read the
    // first half again), which the head size 128 case must catch: the mutations below take head size 64,
    // which stages V whole.
    if (products === 'int8' && served(128)) {
      const at = INT8_PREFILL_CASES.findIndex(([, shape]) => shape.headDim === 128);
      const [, shape, chunks, more] = INT8_PREFILL_CASES[at];
      const source = attentionPrefillInt8Source({ headDim: 128, quant: null, converted: true });
      const broken = edited(
        source,
        (c) => c.replaceAll(/vcodes\[word \+ \du\] = ahead\[[67]\]\[\d\];/g, ''),
        'split V mutation',
      );
      const { ratios } = await runSteps(gpu, shape, chunks, 57 + 128, 4, {
        ...more,
        prefillProducts: products,
        sources: { prefillInt8: broken },
        tolerance: INT8_ATTENTION_TOLERANCE,
      });
      const ratio = Math.max(...ratios);
      report("mutation 'second half of V's dims not staged' caught (head size 128)", ratio, ratio > 1);
    }
    for (const [name, c] of INT8_MIXED_CASES) {
      if (!served(c.headDim)) continue;
      const r = await runMixed(gpu, c, 4242, { prefillProducts: products, tolerance: INT8_ATTENTION_TOLERANCE });
      report(`over quant pages, ${name}`, r.worst, r.worst <= 1 && r.mismatchedCodes === 0 && r.quantPositions > 0);
    }
    if (!served(64)) continue;
    for (const convertKeys of products === 'int8' ? [true, false] : [true]) {
      for (const [name, edit, at] of INT8_PREFILL_MUTATIONS[products]) {
        // The page-reading build has no keys buffer to misread.
        if (!convertKeys && name === 'values read from the keys') continue;
        const ratio = await int8MutationRatio(gpu, edit, products, convertKeys, at);
        report(`mutation '${name}' caught${convertKeys ? '' : ', tiles from the pages'}`, ratio, ratio > 1);
      }
    }
  }
}
for (const shape of layerShapesNamed(shapesArg)) {
  if (values.prefill) {
    for (const splits of prefillSplitCounts) {
      const rows = await benchPrefillShape(
        gpu,
        shape,
        contexts,
        kv === 'f16' ? 'f16' : 'quant',
        Number(values.tokens),
        values['ablate-int8'],
        splits,
        onlyKernels,
      );
      results.push(...rows);
    }
  } else results.push(...(await (kv === 'int2' ? benchQuantShape : benchShape)(gpu, shape, contexts, onlyKernels)));
}
if (values.out)
  writeFileSync(
    values.out,
    `${JSON.stringify({ adapter: gpu.adapter, kv, prefill: values.prefill, splits: values.prefill ? (values.splits ?? 'prefillSplitsFor') : 'decodeSplitsFor(kvHeads)', minChunk: values.prefill ? PREFILL_MIN_CHUNK_KEYS : MIN_CHUNK, results }, null, 1)}\n`,
  );
gpu.destroy();
process.exit(process.exitCode ?? 0);
