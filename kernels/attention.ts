import { InvalidRequestError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import {
  ATTENTION_MAX_HEAD_DIM,
  ATTENTION_MAX_ROW_PAIRS,
  ATTENTION_MAX_ROWS,
  ATTENTION_MAX_SPLITS,
  type AttentionBlockKeys,
  type AttentionKernelShape,
  attentionMergeRowsSource,
  attentionMergeRowsSupports,
  attentionMergeRowsWorkgroups,
  attentionMergeSource,
  attentionPartialSource,
  attentionQuantBlockKeys,
  attentionRunsHeadDim,
  attentionWorkgroupBytes,
  MAX_WINDOW,
  MERGE_NARROW_HEAD_DIM,
} from './attention.wgsl.ts';
import {
  type AttentionDecodeShape,
  attentionDecodePassKeys,
  attentionDecodeSource,
  attentionDecodeSupports,
  attentionDecodeWorkgroupBytes,
  type DecodeQuantShape,
} from './attention-decode.wgsl.ts';
import { type AttentionPrefillShape, attentionPrefillShape, attentionPrefillSource } from './attention-prefill.wgsl.ts';
import {
  type AttentionPrefillDotShape,
  attentionPrefillDotShape,
  attentionPrefillDotSource,
} from './attention-prefill-dot.wgsl.ts';
import {
  type AttentionPrefillInt8Shape,
  attentionKeysInt8Source,
  attentionPrefillInt8Shape,
  attentionPrefillInt8Source,
  INT8_ATTENTION_ROWS,
  INT8_ATTENTION_TILE_KEYS,
  keysInt8Bytes,
  keysInt8Capacity,
} from './attention-prefill-int8.wgsl.ts';
import { type KvPageSource, kvPoolDispatch } from './kv-append.ts';
import type { KvQuantPages } from './kv-demote.ts';
import { pipelineCompiles } from './matmul-int8.ts';

export interface AttentionBinding {
  /** With `quant` set (pool mode 'quant'), the mixed kernel reads f16 and quant pages. */
  pool: KvPageSource & { readonly quant?: KvQuantPages | null };
  layer: number;
  /** f32 [tokens, heads*headDim], RoPE applied. */
  q: GPUBuffer;
  /** f32 [tokens, heads*headDim]. */
  output: GPUBuffer;
  heads: number;
  /** Most query tokens per step (the grid); the step uniform says how many there are. */
  maxTokens: number;
  /** Usually 1/sqrt(headDim). */
  scale: number;
  /**
   * A sliding-window layer's window: the query at position p sees the keys p − window + 1 .. p (its own included, as
   * llama.cpp's LLAMA_SWA_TYPE_STANDARD). Absent: keys 0..p.
   */
  window?: number;
  /**
   * Chunks the keys are cut into (one workgroup each, merged after). Default: 32 when maxTokens = 1 (decode: a long
   * context uses many workgroups), 1 otherwise (prefill: the query tokens give the parallelism, no merge pass).
   */
  splits?: number;
  /**
   * Fewest keys per split (default 1): with it, `splits` is a ceiling, and a step of `length` keys uses
   * ceil(length / max(minChunkKeys, ceil(length / splits))) of them, so one prepared graph suits short and long
   * contexts.
   */
  minChunkKeys?: number;
  /**
   * Prefill graphs (maxTokens > 1) only: with it, `splits` is a ceiling too, and a step of t tokens takes
   * splitsOfStep(splits, splitRows, t·heads) splits: a long step walks its keys in fewer, longer splits (and merges
   * fewer partials), a short one keeps enough workgroups. Default 0: every step takes `splits`. Decode graphs must
   * leave it 0: the decode kernel writes its partials `splits` apart.
   */
  splitRows?: number;
  /**
   * Scratch for the split pass's partial results (splits > 1), at least `attentionPartialsBytes(...)`; default: a
   * buffer
   * of its own, owned by the dispatch. Layers run one after another, so one graph's layers can share one.
   */
  partials?: GPUBuffer;
  /**
   * Keys per tile of the split kernel (default 16, the fastest measured; fits WebGPU's default 16 KiB storage). The
   * prefill kernel picks its own tile (attentionPrefillShape).
   */
  blockKeys?: AttentionBlockKeys;
  /**
   * maxTokens = 1: use the decode kernel (attention-decode.wgsl.ts) where it serves the shape (default true); false
   * keeps the general split kernel (same-machine comparisons).
   */
  decodeKernel?: boolean;
  /**
   * maxTokens > 1: use the prefill kernel (attention-prefill.wgsl.ts) where it serves the shape (default true); false
   * keeps the general split kernel (same-machine comparisons, tests of both).
   */
  prefillKernel?: boolean;
  /**
   * Workgroup storage the prefill kernel may use (default: the device's limit). Less makes it take a smaller build, as
   * a device with less storage would (tests of the builds other devices take).
   */
  prefillStorageBytes?: number;
  /**
   * The prefill kernel's products: 'f32' (default); 'int8' on 8-bit tensor cores (attention-prefill-int8.wgsl.ts)
   * where the device has i8 subgroup matrices; 'int8-dot', the same arithmetic on dot4I8Packed
   * (attention-prefill-dot.wgsl.ts) where it has subgroups. Where the chosen kernel does not serve the shape, the f32
   * kernels do.
   */
  prefillProducts?: AttentionProducts;
  /**
   * 'int8' on tensor cores: convert the step's keys to int8 codes once, in a pass of their own, into a buffer of
   * keysInt8Bytes(the pool's longest sequence, ...) (default true where that fits a storage binding); false converts
   * each tile from the pages in every workgroup that reads it (same codes, same results).
   */
  convertKeys?: boolean;
  /**
   * The int8 keys buffer of the conversion pass, at least keysInt8Bytes(maxPagesPerSequence × pageTokens, ...);
   * default: a buffer of its own, owned by the dispatch. Layers run one after another, so they can share one.
   */
  keysInt8?: GPUBuffer;
  /**
   * Decode (maxTokens = 1): multiply each head's output by Rᵀ in the merge pass (a rotated cache's un-rotation, as
   * kernels/rotate.ts would do in a dispatch of its own). Needs a merge pass (splits > 1). Prefill graphs un-rotate
   * with the rotate kernel, whose prefill build reads each matrix once for a block of tokens.
   */
  outputRotation?: OutputRotation;
  /** The kernel plan of the binding's graph and layer format, where the caller decided it once for many layers. */
  plan?: AttentionKernelPlan;
}

/** Per-head matrices the merge pass un-rotates the output with: head h uses matrix firstMatrix + h / headsPerMatrix. */
export interface OutputRotation {
  /** f32 [matrices × headDim × headDim], row-major. */
  matrices: GPUBuffer;
  firstMatrix: number;
  headsPerMatrix: number;
}

/** 'int8': on tensor cores (attention-prefill-int8.wgsl.ts); 'int8-dot': on dot4I8Packed (attention-prefill-dot.wgsl.ts). */
export type AttentionProducts = 'f32' | 'int8' | 'int8-dot';

/** The splits a step of `rows` (token, head) rows takes (the kernels' splitsOfStep, SPLIT_CHUNK_WGSL). */
export function splitsOfStep(splits: number, splitRows: number, rows: number): number {
  return splitRows === 0 ? splits : Math.min(splits, Math.max(1, Math.ceil(splitRows / rows)));
}

/**
 * Bytes of the split pass's partial results: (max, sum, Σ p·V) per query token, head and split of the largest step
 * of up to maxTokens tokens (with splitRows, a longer step takes fewer splits).
 */
export function attentionPartialsBytes(
  maxTokens: number,
  heads: number,
  splits: number,
  headDim: number,
  splitRows = 0,
): number {
  let records = 0;
  for (let tokens = 1; tokens <= maxTokens; tokens++) {
    records = Math.max(records, tokens * heads * splitsOfStep(splits, splitRows, tokens * heads));
  }
  return records * (headDim + 2) * 4;
}

/** The quant row formats of a layer's pages (bits and group), or null for an f16-only pool. */
function layerQuantShape(b: Pick<AttentionBinding, 'pool' | 'layer'>): DecodeQuantShape | null {
  const quant = b.pool.quant ?? null;
  const key = quant?.rows(b.layer, 0).format;
  const value = quant?.rows(b.layer, 1).format;
  return quant && key && value
    ? {
        kBits: key.bits,
        kGroup: key.groupSize,
        vBits: value.bits,
        vGroup: value.groupSize,
        rowTokens: quant.positionsPerRow,
      }
    : null;
}

/** What of a device the choice of an attention kernel reads (a GpuContext, or an adapter profile in docs tables). */
export interface AttentionDevice {
  limits: Pick<
    GpuContext['limits'],
    'maxComputeWorkgroupStorageSize' | 'maxStorageBufferBindingSize' | 'maxComputeWorkgroupsPerDimension'
  >;
  features: Pick<GpuContext['features'], 'subgroups' | 'subgroupMatrixI8'>;
  adapter: Pick<GpuContext['adapter'], 'isFallbackAdapter' | 'subgroupMinSize' | 'subgroupMaxSize'>;
}

/**
 * What the choice of an attention kernel depends on besides the device: the graph's size, the heads, the layer's
 * page formats and the pool's longest sequence; the rest are the binding's overrides (tests and harnesses).
 */
export interface AttentionGraphShape
  extends Pick<
    AttentionBinding,
    'decodeKernel' | 'prefillKernel' | 'prefillStorageBytes' | 'prefillProducts' | 'convertKeys' | 'blockKeys'
  > {
  maxTokens: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  /** The layer's quant row formats, or null where its pages are all f16. */
  quant: DecodeQuantShape | null;
  /** Bytes of the int8 keys of the pool's longest sequence (poolKeysInt8Bytes): the converted build binds them. */
  keysInt8Bytes: number;
}

/** The graph shape of a binding (heads default to the pool's KV heads where the caller gave none). */
export function attentionGraphShape(
  b: Pick<AttentionBinding, 'pool' | 'layer' | 'maxTokens'> & Partial<AttentionBinding>,
): AttentionGraphShape {
  const { pool } = b;
  return {
    maxTokens: b.maxTokens,
    heads: b.heads ?? pool.kvHeads,
    kvHeads: pool.kvHeads,
    headDim: pool.headDim,
    quant: layerQuantShape(b),
    keysInt8Bytes: poolKeysInt8Bytes(pool),
    decodeKernel: b.decodeKernel,
    prefillKernel: b.prefillKernel,
    prefillStorageBytes: b.prefillStorageBytes,
    prefillProducts: b.prefillProducts,
    convertKeys: b.convertKeys,
    blockKeys: b.blockKeys,
  };
}

/** The decode kernel's shape for a graph, or null where another kernel serves it. */
function decodeShapeOf(device: AttentionDevice, g: AttentionGraphShape): AttentionDecodeShape | null {
  if (g.maxTokens !== 1 || g.decodeKernel === false) return null;
  const layer = { headDim: g.headDim, rows: g.heads / g.kvHeads, quant: g.quant };
  const shape: AttentionDecodeShape = {
    // Every build keeps its loops: measured faster than unrolled builds on large GPUs for both page kinds, and CPU
    // drivers compile loops several times faster (bench/attention-kernels.ts;
    // bench/results/2026-12-01-nvidia-h200-session13-attention-decode-int2-raw-unrolled.json).
    unrolled: false,
    ...layer,
    passKeys: attentionDecodePassKeys(layer),
  };
  if (!attentionDecodeSupports(shape)) return null;
  // A device with less workgroup memory (16 KiB, WebGPU's default limit) takes shorter passes before the split kernel.
  const limit = device.limits.maxComputeWorkgroupStorageSize;
  for (const passKeys of new Set([shape.passKeys, 128] as const)) {
    if (attentionDecodeWorkgroupBytes({ ...shape, passKeys }) <= limit) return { ...shape, passKeys };
  }
  return null;
}

/** The f32 prefill kernel's shape for a graph, or null where another kernel serves it. */
function prefillShapeOf(device: AttentionDevice, g: AttentionGraphShape): AttentionPrefillShape | null {
  if (g.maxTokens === 1 || g.prefillKernel === false) return null;
  const limit = device.limits.maxComputeWorkgroupStorageSize;
  return attentionPrefillShape(g.headDim, g.quant, Math.min(limit, g.prefillStorageBytes ?? limit));
}

/** The dot4I8Packed int8 prefill kernel's shape for a graph ('int8-dot' on a device with subgroups), or null. */
function prefillDotShapeOf(device: AttentionDevice, g: AttentionGraphShape): AttentionPrefillDotShape | null {
  if (g.maxTokens === 1 || g.prefillKernel === false || g.prefillProducts !== 'int8-dot') return null;
  // Invocation pairs share rows through subgroupShuffleXor, and the 128 invocations must fill whole subgroups of an
  // even size to map onto the 64 rows once each.
  const { subgroupMinSize = 0, subgroupMaxSize = 0 } = device.adapter;
  if (!device.features.subgroups || subgroupMinSize < 2 || subgroupMaxSize < 2 || 128 % subgroupMaxSize !== 0) {
    return null;
  }
  const limit = device.limits.maxComputeWorkgroupStorageSize;
  return attentionPrefillDotShape(g.headDim, g.quant, limit, !device.adapter.isFallbackAdapter);
}

/** The tensor-core int8 prefill kernel's shape for a graph ('int8' on a device with i8 subgroup matrices), or null. */
function prefillInt8ShapeOf(device: AttentionDevice, g: AttentionGraphShape): AttentionPrefillInt8Shape | null {
  if (g.maxTokens === 1 || g.prefillKernel === false || g.prefillProducts !== 'int8') return null;
  if (!device.features.subgroupMatrixI8) return null;
  const converted = g.convertKeys !== false && g.keysInt8Bytes <= device.limits.maxStorageBufferBindingSize;
  const limit = device.limits.maxComputeWorkgroupStorageSize;
  // The converted build's transposed V tile takes a little more workgroup storage than the page build's tile.
  return (
    (converted ? attentionPrefillInt8Shape(g.headDim, g.quant, limit, true) : null) ??
    attentionPrefillInt8Shape(g.headDim, g.quant, limit)
  );
}

/** The decode kernel's shape for a binding, or null where the split kernel serves it. */
export function attentionDecodeShape(
  device: AttentionDevice,
  b: Pick<AttentionBinding, 'pool' | 'layer' | 'heads' | 'maxTokens' | 'decodeKernel'>,
): AttentionDecodeShape | null {
  return decodeShapeOf(device, attentionGraphShape(b));
}

/** The prefill kernel's shape for a binding, or null where the split kernel serves it. */
export function attentionPrefillShapeFor(
  device: AttentionDevice,
  b: Pick<AttentionBinding, 'pool' | 'layer' | 'maxTokens' | 'prefillKernel' | 'prefillStorageBytes'>,
): AttentionPrefillShape | null {
  return prefillShapeOf(device, attentionGraphShape(b));
}

/**
 * The dot4I8Packed int8 prefill kernel's shape for a binding (prefillProducts 'int8-dot', a device with subgroups), or
 * null where the f32 kernels serve it.
 */
export function attentionPrefillDotShapeFor(
  device: AttentionDevice,
  b: Pick<AttentionBinding, 'pool' | 'layer' | 'maxTokens' | 'prefillKernel' | 'prefillProducts'>,
): AttentionPrefillDotShape | null {
  return prefillDotShapeOf(device, attentionGraphShape(b));
}

/** The int8 prefill kernel's shape for a binding, or null where the f32 kernels serve it. */
export function attentionPrefillInt8ShapeFor(
  device: AttentionDevice,
  b: Pick<AttentionBinding, 'pool' | 'layer' | 'maxTokens' | 'prefillKernel' | 'prefillProducts' | 'convertKeys'>,
): AttentionPrefillInt8Shape | null {
  return prefillInt8ShapeOf(device, attentionGraphShape(b));
}

/** The attention kernels, by what they serve (docs/attention-plans.md says which runs where). */
export type AttentionKernel = 'decode' | 'prefill' | 'prefill-int8' | 'prefill-dot' | 'split';

/** The kernel one graph's attention runs for one layer format, decided once from the device and the graph's shape. */
export type AttentionKernelPlan = {
  /** The pipeline's label (its cache key besides the code). */
  label: string;
  /** (query token, head) rows one workgroup serves. */
  rows: number;
} & (
  | { kernel: 'decode'; shape: AttentionDecodeShape }
  | { kernel: 'prefill'; shape: AttentionPrefillShape }
  | { kernel: 'prefill-int8'; shape: AttentionPrefillInt8Shape }
  | { kernel: 'prefill-dot'; shape: AttentionPrefillDotShape }
  | { kernel: 'split'; shape: AttentionKernelShape }
);

/**
 * Which attention kernel serves a graph, first that applies: the int8 prefill kernel its products ask for (tensor
 * cores or dot4I8Packed), the f32 prefill kernel, the decode kernel, else the general split kernel (any shape, any
 * device). Pure: the same device and shape always give the same plan.
 */
export function planAttentionKernel(device: AttentionDevice, g: AttentionGraphShape): AttentionKernelPlan {
  const { headDim, maxTokens } = g;
  const int8 = prefillInt8ShapeOf(device, g);
  if (int8) {
    const label = `attention-prefill-int8-hd${headDim}${int8.converted ? '-converted' : formatsLabel(int8.quant)}`;
    return { kernel: 'prefill-int8', shape: int8, label, rows: INT8_ATTENTION_ROWS };
  }
  const dot = prefillDotShapeOf(device, g);
  if (dot) {
    return {
      kernel: 'prefill-dot',
      shape: dot,
      label: `attention-prefill-dot-hd${headDim}${formatsLabel(dot.quant)}`,
      rows: INT8_ATTENTION_ROWS,
    };
  }
  const prefill = prefillShapeOf(device, g);
  if (prefill) {
    const label = `attention-prefill-hd${headDim}-r${prefill.rows}-b${prefill.blockKeys}${formatsLabel(prefill.quant)}`;
    return { kernel: 'prefill', shape: prefill, label, rows: prefill.rows };
  }
  const group = g.heads / g.kvHeads;
  const rowCap = Math.min(ATTENTION_MAX_ROWS, Math.floor(ATTENTION_MAX_ROW_PAIRS / (headDim / 2)));
  const rows = Math.min(rowCap, maxTokens === 1 ? group : maxTokens * group);
  const limit = device.limits.maxComputeWorkgroupStorageSize;
  const tiles = (blockKeys: AttentionBlockKeys): AttentionKernelShape => ({
    quant: g.quant !== null,
    blockKeys,
    headDim,
    rows,
  });
  // Tiles of 16 keys, or of 8 where heads of 256 dims would not fit 16 in the device's workgroup memory.
  const shape = tiles(g.blockKeys ?? (attentionWorkgroupBytes(tiles(16)) <= limit ? 16 : 8));
  const storage = attentionWorkgroupBytes(shape);
  if (storage > limit) {
    throw new InvalidRequestError(
      `attention: tiles of ${shape.blockKeys} keys need ${storage} bytes of workgroup storage, the device has ${device.limits.maxComputeWorkgroupStorageSize}`,
    );
  }
  const decode = decodeShapeOf(device, g);
  if (decode) {
    const label = `attention-decode-hd${headDim}-r${decode.rows}-keys${decode.passKeys}${decode.unrolled ? '' : '-loops'}${formatsLabel(decode.quant)}`;
    return { kernel: 'decode', shape: decode, label, rows };
  }
  const label = `${g.quant ? 'attention-mixed' : 'attention-partial'}-${shape.blockKeys}-hd${headDim}-r${rows}`;
  return { kernel: 'split', shape, label, rows };
}

/**
 * A sliding-window layer's plan: the graph's kernel in its windowed build (WindowedShape), under a label of its own.
 * The kernel choice stays the graph's, so windowed and whole-sequence layers of one graph take the same kernel.
 */
function windowedPlan(plan: AttentionKernelPlan): AttentionKernelPlan {
  const label = `${plan.label}-window`;
  // Each branch spreads its own shape type (a union-wide spread would lose which shape goes with which kernel).
  switch (plan.kernel) {
    case 'prefill-int8':
      return { ...plan, label, shape: { ...plan.shape, windowed: true } };
    case 'prefill-dot':
      return { ...plan, label, shape: { ...plan.shape, windowed: true } };
    case 'prefill':
      return { ...plan, label, shape: { ...plan.shape, windowed: true } };
    case 'decode':
      return { ...plan, label, shape: { ...plan.shape, windowed: true } };
    case 'split':
      return { ...plan, label, shape: { ...plan.shape, windowed: true } };
  }
}

/** The WGSL of a plan's kernel. */
function planSource(plan: AttentionKernelPlan): string {
  switch (plan.kernel) {
    case 'prefill-int8':
      return attentionPrefillInt8Source(plan.shape);
    case 'prefill-dot':
      return attentionPrefillDotSource(plan.shape);
    case 'prefill':
      return attentionPrefillSource(plan.shape);
    case 'decode':
      return attentionDecodeSource(plan.shape);
    case 'split':
      return attentionPartialSource(plan.shape);
  }
}

/**
 * Whether an int8 prefill attention (`products`: 'int8' on tensor cores, 'int8-dot' on dot4I8Packed) serves and
 * compiles here for `headDim`: its f16-pool build and a 2-bit quant-pool build (the quant formats differ only in
 * constants). A browser whose WGSL lacks a form it uses keeps the f32 kernels (ModelRunner.load's probe).
 */
export async function int8PrefillAttentionCompiles(
  gpu: GpuContext,
  headDim: number,
  products: 'int8' | 'int8-dot',
): Promise<boolean> {
  const limit = gpu.limits.maxComputeWorkgroupStorageSize;
  const int2 = { kBits: 2, kGroup: headDim, vBits: 2, vGroup: headDim, rowTokens: 1 } as const;
  for (const quant of [null, int2]) {
    let sources: (string | null)[] = [null];
    if (products === 'int8' && gpu.features.subgroupMatrixI8) {
      // Both builds (converted keys, and the pages' where the keys buffer would not fit a binding) and the conversion.
      const pages = attentionPrefillInt8Shape(headDim, quant, limit);
      const converted = attentionPrefillInt8Shape(headDim, quant, limit, true);
      // Where the converted build does not fit the workgroup storage, the page build serves alone.
      sources = [
        pages && attentionPrefillInt8Source(pages),
        ...(converted
          ? [attentionPrefillInt8Source(converted), attentionKeysInt8Source(converted.headDim, quant)]
          : []),
      ];
    } else if (products === 'int8-dot' && gpu.features.subgroups) {
      const shape = attentionPrefillDotShape(headDim, quant, limit, !gpu.adapter.isFallbackAdapter);
      sources = [shape && attentionPrefillDotSource(shape)];
    }
    for (const source of sources) {
      if (source === null || !(await pipelineCompiles(gpu, source))) return false;
    }
  }
  return true;
}

/**
 * The prefill attention's products for a load option: 'auto' asks for the tensor-core int8 kernel, 'int8-dot' for
 * the dot4I8Packed one; either is kept only where it serves and compiles here for `headDim`
 * (int8PrefillAttentionCompiles), else the f32 kernels run. Decided once at load; the plan of every graph reads it.
 */
export async function prefillAttentionProducts(
  gpu: GpuContext,
  headDim: number,
  requested: 'auto' | 'f32' | 'int8-dot',
): Promise<AttentionProducts> {
  const products = requested === 'auto' ? 'int8' : requested;
  return products !== 'f32' && (await int8PrefillAttentionCompiles(gpu, headDim, products)) ? products : 'f32';
}

/** The most keys a step of one of the pool's sequences sees: its longest sequence. */
function poolMaxKeys(pool: Pick<KvPageSource, 'maxPagesPerSequence' | 'pageTokens'>): number {
  return pool.maxPagesPerSequence * pool.pageTokens;
}

/** Bytes of the int8 keys buffer a pool's prefill attention converts into: keys of its longest sequence. */
export function poolKeysInt8Bytes(
  pool: Pick<KvPageSource, 'maxPagesPerSequence' | 'pageTokens' | 'kvHeads' | 'headDim'>,
) {
  return keysInt8Bytes(poolMaxKeys(pool), pool.kvHeads, pool.headDim);
}

/**
 * Prepares causal attention of the step's queries over the paged KV of `layer` (positions 0..p for the query at
 * position p, or the last `window` of them, including the keys this step appended: record the kv-append dispatch
 * first). Returns the split pass
 * (the whole attention when splits = 1), then the merge pass when splits > 1; the converted int8 build has the
 * conversion of the step's keys before them (prepareKeysInt8). Encode them in order.
 */
export function prepareAttention(gpu: GpuContext, label: string, b: AttentionBinding): PreparedDispatch[] {
  const { pool, heads, maxTokens } = b;
  const { kvHeads, headDim } = pool;
  const splits = b.splits ?? (maxTokens === 1 ? 32 : 1);
  const splitRows = b.splitRows ?? 0;
  if (b.window !== undefined && !(Number.isInteger(b.window) && b.window >= 1 && b.window <= MAX_WINDOW)) {
    throw new InvalidRequestError(`attention: a window of ${b.window} keys; it must be a whole number from 1`);
  }
  if (heads % kvHeads !== 0 || !attentionRunsHeadDim(headDim) || splits < 1 || splits > ATTENTION_MAX_SPLITS) {
    throw new InvalidRequestError(
      `attention: needs heads (${heads}) a multiple of kvHeads (${kvHeads}), a headDim <= ${ATTENTION_MAX_HEAD_DIM} and a multiple of 8 (${headDim}) and 1 <= splits <= ${ATTENTION_MAX_SPLITS}`,
    );
  }
  // The decode kernel's partial records are always `splits` apart.
  if (!Number.isInteger(splitRows) || splitRows < 0 || (splitRows > 0 && maxTokens === 1)) {
    throw new InvalidRequestError(`attention: splitRows (${splitRows}) is a whole number, and 0 for decode graphs`);
  }
  // A workgroup serves `rows` (query token, head) pairs of one KV head: the GQA group in decode, plus several query
  // tokens in prefill, so each K/V block is read once for all of them.
  const group = heads / kvHeads;
  const graphPlan = b.plan ?? planAttentionKernel(gpu, attentionGraphShape(b));
  const plan = b.window === undefined ? graphPlan : windowedPlan(graphPlan);
  const { rows } = plan;
  const tiles = Math.ceil((maxTokens * group) / rows);
  const maxGrid = gpu.limits.maxComputeWorkgroupsPerDimension;
  if (splits > maxGrid || tiles > maxGrid) {
    throw new InvalidRequestError(`attention: grid ${splits} x ${kvHeads} x ${tiles} exceeds ${maxGrid} per dimension`);
  }
  const quant = pool.quant ?? null;
  const int8Prefill = plan.kernel === 'prefill-int8' ? plan.shape : null;
  const partialPipeline = computePipeline(gpu, plan.label, planSource(plan));
  const quantBlockKeys = quant
    ? attentionQuantBlockKeys({
        quant: true,
        blockKeys: plan.kernel === 'split' ? plan.shape.blockKeys : (b.blockKeys ?? 16),
        headDim,
        rows,
      })
    : 0;
  const params = attentionParams(gpu, label, b, {
    splits,
    rows,
    quantBlockKeys,
    int8Keys: int8Prefill?.converted ? poolKeysInt8Capacity(pool) : 0,
  });
  const rotation = b.outputRotation;
  if (rotation && (splits === 1 || maxTokens !== 1)) {
    throw new InvalidRequestError(
      `attention '${label}': an output rotation needs a decode graph with a merge pass (splits > 1, maxTokens 1); ` +
        'un-rotate other outputs with prepareRotate',
    );
  }
  // The converted int8 build: a pass that converts the step's keys into the int8 keys buffer, and the attention
  // reads that buffer instead of the page table and pages.
  const convert = int8Prefill?.converted ? prepareKeysInt8(gpu, label, b) : null;
  const attend = (output: GPUBuffer, splitLabel: string, splitsX: number, owned: GPUBuffer[]): PreparedDispatch[] =>
    convert
      ? [
          convert.dispatch,
          {
            label: splitLabel,
            pipeline: partialPipeline,
            bindGroup: bindBuffers(gpu, splitLabel, partialPipeline, [b.q, output, convert.keys, pool.step, params]),
            workgroups: [splitsX, kvHeads, tiles],
            owned,
          },
        ]
      : [
          kvPoolDispatch(
            gpu,
            splitLabel,
            partialPipeline,
            pool,
            [b.q, output, pool.pageTable, pool.step, params],
            [splitsX, kvHeads, tiles],
            owned,
          ),
        ];
  if (splits === 1) return attend(b.output, label, 1, [params]);
  const partials = givenOrScratch(
    gpu,
    `${label}.partials`,
    b.partials,
    attentionPartialsBytes(maxTokens, heads, splits, headDim, splitRows),
  );
  // Prefill graphs merge a few splits for many queries: one invocation per output dim (attentionMergeRowsSource).
  const rowsGrid = attentionMergeRowsWorkgroups(maxTokens, heads, headDim);
  const mergeRows =
    maxTokens > 1 && attentionMergeRowsSupports(headDim) && rowsGrid <= gpu.limits.maxComputeWorkgroupsPerDimension;
  // Heads past the narrow merge's 128 dims take its wide build.
  const wide = headDim > MERGE_NARROW_HEAD_DIM;
  const mergePipeline = computePipeline(
    gpu,
    `attention-merge${mergeRows ? '-rows' : ''}${rotation ? '-rotated' : ''}${!mergeRows && wide ? '-wide' : ''}`,
    mergeRows ? attentionMergeRowsSource() : attentionMergeSource(rotation !== undefined, wide),
  );
  const mergeParams = uniformBuffer(
    gpu,
    `${label}.merge.params`,
    [
      heads,
      headDim,
      splits,
      b.minChunkKeys ?? 1,
      rotation?.firstMatrix ?? 0,
      rotation?.headsPerMatrix ?? 1,
      splitRows,
      0,
    ],
    'uuuuuuuu',
  );
  const mergeBuffers = [partials, b.output, pool.step, mergeParams, ...(rotation ? [rotation.matrices] : [])];
  return [
    ...attend(partials, `${label}.split`, splits, b.partials ? [params] : [params, partials]),
    {
      label: `${label}.merge`,
      pipeline: mergePipeline,
      bindGroup: bindBuffers(gpu, `${label}.merge`, mergePipeline, mergeBuffers),
      workgroups: mergeRows ? [rowsGrid, 1, 1] : [heads, maxTokens, 1],
      owned: [mergeParams],
    },
  ];
}

/** A pipeline label's part for a pool's quant formats ('' for an f16-only pool). */
function formatsLabel(quant: DecodeQuantShape | null): string {
  if (!quant) return '';
  // Positions per stored row only where a group spans several (labels of one-position rows stay as they were).
  const rows = quant.rowTokens > 1 ? `-t${quant.rowTokens}` : '';
  return `-k${quant.kBits}g${quant.kGroup}-v${quant.vBits}g${quant.vGroup}${rows}`;
}

/**
 * The scratch buffer a binding passed (checked to hold `bytes`: layers share one), or a storage buffer of its own,
 * which the caller's dispatch owns.
 */
function givenOrScratch(gpu: GpuContext, label: string, given: GPUBuffer | undefined, bytes: number): GPUBuffer {
  if (given && given.size < bytes) {
    throw new InvalidRequestError(`attention: ${label} buffer of ${given.size} bytes, needs ${bytes}`);
  }
  return (
    given ?? gpu.allocator.createBuffer({ label, category: 'scratch', size: bytes, usage: GPUBufferUsage.STORAGE })
  );
}

/** The Params uniform of the attention kernels (attentionParamsWgsl) for a binding. */
function attentionParams(
  gpu: GpuContext,
  label: string,
  b: AttentionBinding,
  fields: { splits: number; rows: number; quantBlockKeys: number; int8Keys: number },
): GPUBuffer {
  const { pool } = b;
  const words = [
    pool.layerOffsetWords(b.layer, 0),
    pool.layerOffsetWords(b.layer, 1),
    pool.pageWords,
    pool.pageTokens,
    b.heads,
    pool.kvHeads,
    pool.headDim,
    fields.splits,
    b.scale,
    fields.rows,
    b.minChunkKeys ?? 1,
    fields.int8Keys,
    b.splitRows ?? 0,
  ];
  const quant = pool.quant ?? null;
  if (quant) {
    const key = quant.rows(b.layer, 0);
    const value = quant.rows(b.layer, 1);
    words.push(
      quant.pageWords,
      quant.layerOffsetWords(b.layer, 0),
      quant.layerOffsetWords(b.layer, 1),
      fields.quantBlockKeys,
      key.format.bits,
      key.format.groupSize,
      key.codeWords,
      key.rowWords,
      value.format.bits,
      value.format.groupSize,
      value.codeWords,
      value.rowWords,
      quant.positionsPerRow,
    );
  }
  // Last, where only the windowed builds declare it (attentionParamsWgsl).
  if (b.window !== undefined) words.push(b.window);
  return uniformBuffer(gpu, `${label}.params`, words, 'uuuuuuuufuuuu'.padEnd(words.length, 'u'));
}

/** Keys per KV head of a pool's int8 keys buffer (params.int8Keys). */
export function poolKeysInt8Capacity(pool: Pick<KvPageSource, 'maxPagesPerSequence' | 'pageTokens'>): number {
  return keysInt8Capacity(poolMaxKeys(pool));
}

/**
 * The conversion pass of the converted int8 prefill attention (attentionKeysInt8Source): every key of the step
 * (0..step.length) of `b.layer`, a workgroup per tile of 64 keys and KV head (tiles past the step's keys return at
 * once), into `b.keysInt8` or a buffer of its own (`keys`, owned by the dispatch). Needs subgroups
 * (the invocations of a pair share a key's largest magnitude).
 */
export function prepareKeysInt8(
  gpu: GpuContext,
  label: string,
  b: AttentionBinding,
): { dispatch: PreparedDispatch; keys: GPUBuffer } {
  const { pool } = b;
  const { headDim } = pool;
  if (headDim !== 64 && headDim !== 128) {
    throw new InvalidRequestError(`attention: int8 keys need headDim 64 or 128, got ${headDim}`);
  }
  if (!gpu.features.subgroups) {
    throw new InvalidRequestError(
      "attention: converting keys to int8 needs the 'subgroups' feature, which this device lacks",
    );
  }
  const keys = givenOrScratch(gpu, `${label}.keys_int8`, b.keysInt8, poolKeysInt8Bytes(pool));
  const quant = layerQuantShape(b);
  const pipeline = computePipeline(
    gpu,
    `attention-keys-int8-hd${headDim}${formatsLabel(quant)}`,
    attentionKeysInt8Source(headDim, quant),
  );
  const capacity = poolKeysInt8Capacity(pool);
  // The conversion reads no window (its build declares none).
  const params = attentionParams(
    gpu,
    `${label}.keys_int8`,
    { ...b, window: undefined },
    {
      splits: 1,
      rows: 0,
      quantBlockKeys: 0,
      int8Keys: capacity,
    },
  );
  const dispatch = kvPoolDispatch(
    gpu,
    `${label}.keys_int8`,
    pipeline,
    pool,
    [keys, pool.pageTable, pool.step, params],
    [capacity / INT8_ATTENTION_TILE_KEYS, pool.kvHeads, 1],
    b.keysInt8 ? [params] : [params, keys],
  );
  return { dispatch, keys };
}
