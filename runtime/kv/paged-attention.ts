import { InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { type PreparedDispatch, prepareAllOrNone, releaseDispatches } from '../../core/gpu/dispatch.ts';
import {
  type AttentionDevice,
  type AttentionGraphShape,
  type AttentionKernelPlan,
  type AttentionProducts,
  attentionGraphShape,
  attentionPartialsBytes,
  planAttentionKernel,
  poolKeysInt8Bytes,
  prepareAttention,
} from '../../kernels/attention.ts';
import { prepareKvAppend } from '../../kernels/kv-append.ts';
import { prepareKvDemote } from '../../kernels/kv-demote.ts';
import { prepareRopeStage, type RopeStage } from '../../kernels/rope.ts';
import { prepareRopeAppend, ropeAppendFits } from '../../kernels/rope-append.ts';
import { prepareRotate } from '../../kernels/rotate.ts';
import type { KvAttentionBackend, LayerAttention } from '../model/transformer.ts';
import type { KvPagePool } from './pool.ts';
import { type KvRotation, rotationSet, transposedMatrices } from './rotation.ts';

export interface PagedAttentionOptions {
  /** Query heads (a multiple of the pool's kvHeads). */
  heads: number;
  /** Default 1/sqrt(headDim). */
  scale?: number;
  /** Most key splits of a decode graph (maxTokens = 1); default decodeSplitsFor(kvHeads). */
  decodeSplits?: number;
  /**
   * Products of the prefill attention: 'f32' (default), 'int8' on 8-bit tensor cores or 'int8-dot' on dot4I8Packed
   * where the device runs them (kernels/attention.ts; ModelRunner.load's prefillAttention).
   */
  prefillProducts?: AttentionProducts;
  /**
   * The rotated cache's matrices (createKvAttention uploads them): q and k are multiplied by R_K after RoPE and v by
   * R_V before they are stored, so q·k is unchanged; the attention output is multiplied back by R_Vᵀ. Absent: the
   * cache stores K/V as they are.
   */
  rotations?: KvRotations;
}

/**
 * The rotation matrices of a rotated cache, f32 [layers × kvHeads × headDim × headDim] row-major, KV head h of layer
 * l at matrix l·kvHeads + h (query heads of a GQA group use their KV head's).
 */
export interface KvRotations {
  key: GPUBuffer;
  value: GPUBuffer;
  /**
   * `value` with each matrix transposed (or `value` itself where its matrices are symmetric), for the un-rotation
   * dispatch of graphs without a merge pass: a product with Rᵀ read row-wise from it is a plain product, whose matrix
   * loads coalesce (measured faster than reading R column-wise:
   * bench/results/2026-12-01-nvidia-h200-session22-rotate-kernel.json, from `bench/rotate-kernel.ts`).
   */
  valueTransposed: GPUBuffer;
}

/** Decode: fewest keys per split. */
const DECODE_MIN_CHUNK_KEYS = 64;

/**
 * Most key splits of a decode step, each at least DECODE_MIN_CHUNK_KEYS keys (16 splits at 1K keys): about 512
 * workgroups (splits × kvHeads), at most 128 splits. For 8 KV heads, 64 splits beat 128 on every pool, model and
 * context measured (bench/results/2026-12-01-nvidia-h200-session13-attention-decode-{int2,f16}-splits.json), and
 * 128 had beaten 256 (bench/results/2026-11-30-nvidia-h200-session4-final-attention-kernels.json). Fewer KV heads
 * keep 128.
 */
export function decodeSplitsFor(kvHeads: number): number {
  return Math.max(1, Math.min(128, Math.floor(512 / kvHeads)));
}
/**
 * Prefill graphs split the keys too, once a step sees more than PREFILL_MIN_CHUNK_KEYS of them: without splits, one
 * workgroup walks every key of a long context for its query tile (prefill at 32K ran much slower than llama.cpp on a
 * large GPU: bench/journal.md, the first H200 section, 2026-11-29). The partials of a prefill graph are large (tokens ×
 * heads × splits), so its layers share one buffer.
 */
export const PREFILL_SPLITS = 16;
/**
 * Prefill splits where the tensor-core int8 attention serves the graph: a step takes at most PREFILL_INT8_SPLITS, and
 * as many as bring it to PREFILL_INT8_SPLIT_ROWS (token, head) rows of splits (AttentionBinding.splitRows): one split
 * from 512 tokens of 32 heads on, two from 256, all 8 up to 73. From a few hundred queries on, one split measured about
 * as fast as more, or faster, and writes fewer partials for the merge
 * (bench/results/2026-12-01-nvidia-h200-session19-attention-int8-splits-{256,512,1024}-f16.json). A short step (a chat
 * turn's few tokens at a long context) needs the workgroups of more splits
 * (bench/results/2026-12-01-nvidia-h200-session19-attention-int8-48-queries-f16.txt).
 */
export const PREFILL_INT8_SPLITS = 8;
export const PREFILL_INT8_SPLIT_ROWS = 16384;

/** A graph's key splits: the most a step takes, and AttentionBinding.splitRows (0: every step takes them all). */
export interface SplitSettings {
  splits: number;
  splitRows: number;
}

/** A prefill graph's split settings (before the partials' binding limit): fewer where int8 serves it. */
export function prefillSplitsFor(int8Served: boolean): SplitSettings {
  return int8Served
    ? { splits: PREFILL_INT8_SPLITS, splitRows: PREFILL_INT8_SPLIT_ROWS }
    : { splits: PREFILL_SPLITS, splitRows: 0 };
}

/**
 * The most of `wanted.splits` whose partials (attentionPartialsBytes: the largest step's records) fit one storage
 * binding of `bindingBytes`: a 512-token Qwen3-4B prefill chunk with 16 splits needs 136 MB, over the 128 MiB of CPU
 * adapters. Fewer splits then; one split needs no partials.
 */
export function splitsWithinBinding(
  wanted: SplitSettings,
  graph: { maxTokens: number; heads: number; headDim: number },
  bindingBytes: number,
): number {
  let splits = wanted.splits;
  while (
    splits > 1 &&
    attentionPartialsBytes(graph.maxTokens, graph.heads, splits, graph.headDim, wanted.splitRows) > bindingBytes
  ) {
    splits--;
  }
  return splits;
}
export const PREFILL_MIN_CHUNK_KEYS = 256;

/**
 * How one graph attends for one layer format, decided once (PagedKvAttention.plan) and shared by every layer of that
 * format: the kernel, the key splits, and where a rotated cache's output is un-rotated.
 */
export interface LayerAttentionPlan {
  kernel: AttentionKernelPlan;
  /** Key splits of the graph's largest step, and AttentionBinding.splitRows (prefill graphs). */
  splits: number;
  splitRows: number;
  /** Fewest keys per split. */
  minChunkKeys: number;
  /** A rotated cache's output: un-rotated by the merge pass (decode graphs with splits), or by a dispatch of its own. */
  unrotate: 'merge' | 'dispatch';
  /** Bytes of the graph's partials buffer (one for all its layers; 0: the graph has a single split or is decode). */
  partialsBytes: number;
}

/**
 * The plan of a graph (`shape.maxTokens` queries) for one layer format. `int8Served`: the tensor-core int8 kernel
 * serves every layer format of the pool, which lets prefill graphs take fewer, longer splits (prefillSplitsFor).
 */
export function planLayerAttention(
  device: AttentionDevice,
  shape: AttentionGraphShape,
  options: { int8Served: boolean; decodeSplits?: number },
): LayerAttentionPlan {
  const decode = shape.maxTokens === 1;
  const kernel = planAttentionKernel(device, shape);
  const wanted: SplitSettings = decode
    ? { splits: options.decodeSplits ?? decodeSplitsFor(shape.kvHeads), splitRows: 0 }
    : prefillSplitsFor(options.int8Served);
  const graph = { maxTokens: shape.maxTokens, heads: shape.heads, headDim: shape.headDim };
  const splits = splitsWithinBinding(wanted, graph, device.limits.maxStorageBufferBindingSize);
  return {
    kernel,
    splits,
    splitRows: wanted.splitRows,
    minChunkKeys: decode ? DECODE_MIN_CHUNK_KEYS : PREFILL_MIN_CHUNK_KEYS,
    // A rotated cache's output is un-rotated by the merge pass of decode graphs (one dispatch fewer a layer), and by a
    // rotate dispatch of its own in prefill graphs, whose build reads each head's matrix once for a block of tokens
    // (measured faster than un-rotating in the merge: bench/journal.md, the rotation's sections).
    unrotate: decode && splits > 1 ? 'merge' : 'dispatch',
    partialsBytes:
      !decode && splits > 1
        ? attentionPartialsBytes(shape.maxTokens, shape.heads, splits, shape.headDim, wanted.splitRows)
        : 0,
  };
}

/**
 * The plans of one graph's layers (`layers[l]` is layer l's shape, all with the graph's maxTokens): one per distinct
 * layer format, shared by the layers of that format. Prefill graphs take fewer, longer splits only where the
 * tensor-core int8 kernel serves every layer format. Pure: docs/attention-plans.md is rendered from it.
 */
export function planGraphAttention(
  device: AttentionDevice,
  layers: readonly AttentionGraphShape[],
  decodeSplits?: number,
): LayerAttentionPlan[] {
  const int8Served = layers.every((s) => s.maxTokens > 1 && planAttentionKernel(device, s).kernel === 'prefill-int8');
  const byFormat = new Map<string, LayerAttentionPlan>();
  return layers.map((shape) => {
    const format = JSON.stringify(shape.quant);
    let plan = byFormat.get(format);
    if (!plan) {
      plan = planLayerAttention(device, shape, { int8Served, decodeSplits });
      byFormat.set(format, plan);
    }
    return plan;
  });
}

/**
 * The paged cache as the forward pass sees it: per layer, `append` finishes this step's q and k (RoPE; the rotation
 * of a rotated cache, which takes v too) and stores k and v, after the demotion of the pages that left the window
 * (quant mode); `attention` attends this step's queries over f16 and quant pages, and un-rotates the output of a
 * rotated cache. Every dispatch binds the pool's KvStep uniform: call `pool.writeStep` (or `pool.beginStep`) before
 * each submit, with tokens <= the maxTokens the graph was prepared for.
 */
export class PagedKvAttention implements KvAttentionBackend {
  readonly pool: KvPagePool;
  private readonly gpu: GpuContext;
  private readonly options: PagedAttentionOptions;
  /** The prefill partials buffer of the graph being prepared (layer 0 allocates it and owns it), by maxTokens. */
  private readonly sharedPartials = new Map<number, GPUBuffer>();
  /** Each graph size's plans by layer (planGraphAttention): decided once, shared by the layers of a format. */
  private readonly plans = new Map<number, LayerAttentionPlan[]>();
  /** The int8 keys buffer of the converted int8 prefill attention, created with the first graph that runs it. */
  private keysInt8: GPUBuffer | null = null;

  constructor(gpu: GpuContext, pool: KvPagePool, options: PagedAttentionOptions) {
    this.gpu = gpu;
    this.pool = pool;
    this.options = options;
  }

  /** The graph shape of `layer` for a graph of `maxTokens` queries. */
  private graphShape(layer: number, maxTokens: number): AttentionGraphShape {
    const { pool, options } = this;
    return attentionGraphShape({
      pool,
      layer,
      maxTokens,
      heads: options.heads,
      prefillProducts: options.prefillProducts,
    });
  }

  /**
   * The plan of `layer` in a graph of `maxTokens` queries: one per layer format (boosted layers may differ), decided
   * on first use. Prefill graphs take fewer splits only where the tensor-core int8 kernel serves every layer format.
   */
  plan(layer: number, maxTokens: number): LayerAttentionPlan {
    let plans = this.plans.get(maxTokens);
    if (!plans) {
      const shapes = Array.from({ length: this.pool.layers }, (_, l) => this.graphShape(l, maxTokens));
      plans = planGraphAttention(this.gpu, shapes, this.options.decodeSplits);
      this.plans.set(maxTokens, plans);
    }
    return plans[layer];
  }

  /**
   * `rope`: the RoPE q and k still need (null: they are final). A decode graph finishes q, k and v and stores k and v
   * in one dispatch (kernels/rope-append.ts) where the device runs it; otherwise RoPE, the rotation and the store are
   * a dispatch each.
   */
  prepareLayer(
    layer: number,
    buffers: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    rope: RopeStage | null,
    layerAttention?: LayerAttention,
  ): { append: PreparedDispatch[]; attention: PreparedDispatch[] } {
    // A layer that cannot be prepared (a kernel refusing a shape) leaves no buffer behind.
    const { gpu } = this;
    const append = prepareAllOrNone(gpu, (made) => this.prepareAppend(made, layer, buffers, maxTokens, rope));
    try {
      const attention = prepareAllOrNone(gpu, (made) =>
        this.prepareAttention(made, layer, buffers, maxTokens, layerAttention),
      );
      return { append, attention };
    } catch (error) {
      releaseDispatches(gpu, append);
      throw error;
    }
  }

  /** Pushes a layer's append (its demotion, then RoPE, the rotation and the store, fused or not) into `made`. */
  private prepareAppend(
    made: PreparedDispatch[],
    layer: number,
    buffers: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    rope: RopeStage | null,
  ): void {
    const { gpu, pool, options } = this;
    const { rotations } = options;
    const label = `kv.layer${layer}.t${maxTokens}`;
    const firstMatrix = layer * pool.kvHeads;
    if (pool.quant) {
      const dispatch = prepareKvDemote(gpu, `${label}.demote`, { pool, layer });
      // Pages leave the f16 window on one decode step in pageTokens: the other steps skip the dispatch. (Set on the
      // dispatch itself: its bind group is a getter that follows slab growth, which a copy would freeze.)
      dispatch.idle = () => pool.stepDemotions === 0;
      made.push(dispatch);
    }
    const fused =
      maxTokens === 1 &&
      rope !== null &&
      ropeAppendFits(gpu, { headNorm: rope.headNorm !== undefined, rotate: rotations !== undefined }, pool.headDim);
    if (fused) {
      made.push(
        prepareRopeAppend(gpu, `blk.${layer}.rope_append`, {
          pool,
          layer,
          ...buffers,
          rope,
          rotation: rotations && { key: rotations.key, value: rotations.value, firstMatrix },
        }),
      );
    } else {
      made.push(...prepareRopeStage(gpu, `blk.${layer}.rope`, rope, buffers.q, buffers.k, maxTokens));
      if (rotations) {
        const part = (x: GPUBuffer, rotation: GPUBuffer, heads: number) => ({
          x,
          rotation,
          firstMatrix,
          heads,
          headsPerMatrix: heads / pool.kvHeads,
          transpose: false,
        });
        // q is final (RoPE applied) before the store, so it is rotated with k and v in one dispatch.
        made.push(
          prepareRotate(gpu, `blk.${layer}.rotate_qkv`, {
            parts: [
              part(buffers.q, rotations.key, options.heads),
              part(buffers.k, rotations.key, pool.kvHeads),
              part(buffers.v, rotations.value, pool.kvHeads),
            ],
            step: pool.step,
            maxTokens,
            headDim: pool.headDim,
          }),
        );
      }
      made.push(
        prepareKvAppend(gpu, `${label}.append`, { pool, layer, k: buffers.k, v: buffers.v, tokens: maxTokens }),
      );
    }
  }

  /**
   * Pushes a layer's attention (the planned kernel, its merge, the un-rotation of a rotated cache) into `made`, with
   * the layer's scale and sliding window where the model gives them.
   */
  private prepareAttention(
    made: PreparedDispatch[],
    layer: number,
    buffers: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    layerAttention: LayerAttention | undefined,
  ): void {
    const { gpu, pool, options } = this;
    const { rotations } = options;
    const label = `kv.layer${layer}.t${maxTokens}`;
    const firstMatrix = layer * pool.kvHeads;
    const headsPerMatrix = options.heads / pool.kvHeads;
    const plan = this.plan(layer, maxTokens);
    const { splits, splitRows } = plan;
    let partials: GPUBuffer | undefined;
    let ownPartials: GPUBuffer | undefined;
    if (plan.partialsBytes > 0) {
      // Layers are prepared in order: layer 0 starts a graph, the rest reuse its buffer, released with layer 0's
      // dispatch.
      partials = layer === 0 ? undefined : this.sharedPartials.get(maxTokens);
      if (!partials) {
        ownPartials = gpu.allocator.createBuffer({
          label: `kv.t${maxTokens}.attention.partials`,
          category: 'scratch',
          size: plan.partialsBytes,
          usage: GPUBufferUsage.STORAGE,
        });
        partials = ownPartials;
        this.sharedPartials.set(maxTokens, ownPartials);
      }
    }
    const int8 = plan.kernel.kernel === 'prefill-int8' ? plan.kernel.shape : null;
    // The int8 keys buffer of the converted int8 prefill attention: every layer of every prefill graph converts into
    // the same one (steps run one after another), sized by the pool's longest sequence; it lives as long as the pool.
    if (int8?.converted && !this.keysInt8) {
      this.keysInt8 = gpu.allocator.createBuffer({
        label: 'kv.attention.keys_int8',
        category: 'scratch',
        size: poolKeysInt8Bytes(pool),
        usage: GPUBufferUsage.STORAGE,
      });
      pool.adopt(this.keysInt8);
    }
    const keysInt8 = int8?.converted ? this.keysInt8! : undefined;
    const unrotateInMerge = rotations !== undefined && plan.unrotate === 'merge';
    let kernel: PreparedDispatch[];
    try {
      kernel = prepareAttention(gpu, `${label}.attention`, {
        pool,
        layer,
        q: buffers.q,
        output: buffers.output,
        heads: options.heads,
        maxTokens,
        scale: layerAttention?.scale ?? options.scale ?? 1 / Math.sqrt(pool.headDim),
        window: layerAttention?.window ?? undefined,
        splits,
        splitRows,
        minChunkKeys: plan.minChunkKeys,
        prefillProducts: options.prefillProducts,
        partials,
        keysInt8,
        outputRotation: unrotateInMerge ? { matrices: rotations.value, firstMatrix, headsPerMatrix } : undefined,
        plan: plan.kernel,
      });
    } catch (error) {
      if (ownPartials) {
        gpu.allocator.release(ownPartials);
        this.sharedPartials.delete(maxTokens);
      }
      throw error;
    }
    if (ownPartials) kernel[0]!.owned.push(ownPartials);
    made.push(...kernel);
    if (rotations && !unrotateInMerge) {
      made.push(
        prepareRotate(gpu, `${label}.unrotate_out`, {
          parts: [
            {
              x: buffers.output,
              rotation: rotations.valueTransposed,
              firstMatrix,
              heads: options.heads,
              headsPerMatrix,
              transpose: false,
            },
          ],
          step: pool.step,
          maxTokens,
          headDim: pool.headDim,
        }),
      );
    }
  }
}

/**
 * The KV backend the forward pass uses for `pool`: PagedKvAttention, with the rotations where the cache stores K/V
 * rotated (`rotation`). The rotation matrices (one per layer and KV head; calibrated ones differ for K and
 * V and come with the value matrices transposed too) are uploaded once, category 'kv', and live as long as the pool.
 */
export function createKvAttention(
  gpu: GpuContext,
  pool: KvPagePool,
  options: PagedAttentionOptions & { rotation: KvRotation },
): KvAttentionBackend {
  const { rotation } = options;
  if (rotation.kind === 'none') return new PagedKvAttention(gpu, pool, options);
  const { layers, kvHeads, headDim } = pool;
  const matrixFloats = layers * kvHeads * headDim * headDim;
  if (
    rotation.kind === 'calibrated' &&
    (rotation.key.length !== matrixFloats || rotation.value.length !== matrixFloats)
  ) {
    throw new InvalidRequestError(
      `KV rotation: calibrated rotations must hold ${matrixFloats} floats each for K and for V.`,
    );
  }
  const upload = (label: string, matrices: Float32Array) => {
    const buffer = gpu.allocator.createBuffer({
      label: `kv.rotation.${label}`,
      category: 'kv',
      size: matrices.byteLength,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST,
    });
    gpu.device.queue.writeBuffer(buffer, 0, matrices.buffer as ArrayBuffer, matrices.byteOffset, matrices.byteLength);
    pool.adopt(buffer);
    return buffer;
  };
  const rotations: KvRotations =
    rotation.kind === 'calibrated'
      ? {
          key: upload('calibrated.key', rotation.key),
          value: upload('calibrated.value', rotation.value),
          valueTransposed: upload('calibrated.value.transposed', transposedMatrices(rotation.value, headDim)),
        }
      : (() => {
          // Sylvester's Hadamard matrix is symmetric: it is its own transpose.
          const shared = upload('hadamard', rotationSet('hadamard', layers, kvHeads, headDim));
          return { key: shared, value: shared, valueTransposed: shared };
        })();
  return new PagedKvAttention(gpu, pool, { ...options, rotations });
}
