/**
 * Reads back what attention sees in the GPU forward pass: per layer, q and k after RoPE, v, and (optionally) the
 * attention output, for every position of a token window. A KV backend wrapper (like the calibration's moment
 * capture) copies the activations into per-layer capture buffers inside each prefill submit, so the Transformer and
 * the decode path are untouched. For runtime/eval/fidelity.ts.
 */

import type { GpuContext } from '../../core/gpu/device.ts';
import { type PreparedDispatch, releaseDispatches } from '../../core/gpu/dispatch.ts';
import { prepareAddInPlace } from '../../kernels/elementwise.ts';
import { prepareRopeStage, type RopeStage } from '../../kernels/rope.ts';
import { createKvAttention } from '../kv/paged-attention.ts';
import { KvPagePool, type KvPoolOptions } from '../kv/pool.ts';
import type { KvRotation } from '../kv/rotation.ts';
import type { ModelConfig } from '../model/config.ts';
import { type KvAttentionBackend, type LayerAttention, Transformer } from '../model/transformer.ts';
import type { ModelWeights } from '../model/weights.ts';
import { StepRunner } from '../step/step-runner.ts';
import type { LayerActivations } from './fidelity.ts';

type Kind = 'q' | 'k' | 'v' | 'output';

/**
 * Copies (as x += y into a buffer cleared before the submit) the layer's q and k after RoPE and v before the cache
 * stores them (before any rotation: this wraps the rotation), and the attention output after it.
 */
class AttentionCapture implements KvAttentionBackend {
  constructor(
    private readonly gpu: GpuContext,
    private readonly inner: KvAttentionBackend,
    private readonly buffers: Array<Record<Kind, GPUBuffer | null>>,
    private readonly widths: Record<Kind, number>,
  ) {}

  prepareLayer(
    layer: number,
    b: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    rope: RopeStage | null,
    attention?: LayerAttention,
  ) {
    const into = this.buffers[layer];
    const roped = prepareRopeStage(this.gpu, `blk.${layer}.rope`, rope, b.q, b.k, maxTokens);
    const copy = (kind: Kind, from: GPUBuffer): PreparedDispatch[] => {
      const target = into[kind];
      if (!target) return [];
      return [
        prepareAddInPlace(this.gpu, `blk.${layer}.capture_${kind}`, {
          x: target,
          y: from,
          count: maxTokens * this.widths[kind],
        }),
      ];
    };
    const before = [...roped, ...copy('q', b.q), ...copy('k', b.k), ...copy('v', b.v)];
    try {
      const inner = this.inner.prepareLayer(layer, b, maxTokens, null, attention);
      return { append: [...before, ...inner.append], attention: [...inner.attention, ...copy('output', b.output)] };
    } catch (error) {
      releaseDispatches(this.gpu, before);
      throw error;
    }
  }
}

export interface CaptureOptions {
  /**
   * The cache the forward runs with (default: f16, one sequence). With a quant pool the captured q/k/v are those of
   * a forward reading a quantized history (for validating the emulation), not the f16 activations.
   */
  pool?: Partial<KvPoolOptions>;
  /** What the cache stores K/V rotated by (default none). */
  rotation?: KvRotation;
  /** Positions per submit (default 128); 1 reproduces decoding's one-token steps. */
  chunk?: number;
  /** Also capture the attention output (default false). */
  output?: boolean;
  /** The layers to capture (default all); the others' entries are empty. */
  layers?: readonly number[];
  /** Awaited before every submit (a background calibration pauses there while requests run). */
  between?: () => Promise<void>;
  onProgress?: (done: number, total: number) => void;
}

/**
 * Runs `tokens` through the model as one sequence (teacher-forced prefill, no logits) and returns each layer's
 * attention inputs. Every GPU buffer it creates is released before it returns.
 */
export async function captureAttentionInputs(
  gpu: GpuContext,
  config: ModelConfig,
  weights: ModelWeights,
  tokens: readonly number[],
  options: CaptureOptions = {},
): Promise<LayerActivations[]> {
  const c = config;
  const n = tokens.length;
  const chunk = Math.min(options.chunk ?? 128, n);
  const widths: Record<Kind, number> = {
    q: c.heads * c.headDim,
    k: c.kvHeads * c.headDim,
    v: c.kvHeads * c.headDim,
    output: c.heads * c.headDim,
  };
  const kinds: Kind[] = options.output ? ['q', 'k', 'v', 'output'] : ['q', 'k', 'v'];
  const f16Bytes = 2 * c.layers * c.kvHeads * c.headDim * 2 * (n + 64);
  const pool = new KvPagePool(gpu, {
    layers: c.layers,
    kvHeads: c.kvHeads,
    headDim: c.headDim,
    budgetBytes: Math.max(f16Bytes, 1 << 20),
    maxSequences: 1,
    maxSequenceTokens: n + 64,
    maxStepTokens: chunk,
    ...options.pool,
  });
  const created: GPUBuffer[] = [];
  const captured = new Set(options.layers ?? Array.from({ length: c.layers }, (_, l) => l));
  const buffers = Array.from({ length: c.layers }, (_, l) => {
    const entry: Record<Kind, GPUBuffer | null> = { q: null, k: null, v: null, output: null };
    if (!captured.has(l)) return entry;
    for (const kind of kinds) {
      entry[kind] = gpu.allocator.createStorage(`fidelity.capture.${l}.${kind}`, 'scratch', chunk * widths[kind] * 4);
      created.push(entry[kind]);
    }
    return entry;
  });
  const rowFloats = kinds.reduce((s, kind) => s + widths[kind], 0);
  const staging = gpu.allocator.createBuffer({
    label: 'fidelity.capture.readback',
    category: 'staging',
    size: Math.max(1, captured.size) * chunk * rowFloats * 4,
    usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
  });
  created.push(staging);
  const out: LayerActivations[] = Array.from({ length: c.layers }, (_, l) => {
    const size = (kind: Kind) => (captured.has(l) ? n * widths[kind] : 0);
    return {
      q: new Float32Array(size('q')),
      k: new Float32Array(size('k')),
      v: new Float32Array(size('v')),
      ...(options.output ? { output: new Float32Array(size('output')) } : {}),
    };
  });
  const backend = new AttentionCapture(
    gpu,
    createKvAttention(gpu, pool, { heads: c.heads, rotation: options.rotation ?? { kind: 'none' } }),
    buffers,
    widths,
  );
  // f32 projections: the captured reference K/V and queries do not depend on the device's int8 tensor cores.
  const transformer = new Transformer(gpu, c, weights, backend, chunk, { prefillMatmul: 'f32' });
  const runner = new StepRunner(gpu, { pool, transformer });
  const seq = pool.createSequence();
  try {
    for (let position = 0; position < n; position += chunk) {
      await options.between?.();
      const ids = tokens.slice(position, position + chunk);
      const count = ids.length;
      const offsets: Array<{ layer: number; kind: Kind; byteOffset: number }> = [];
      let byteOffset = 0;
      for (const l of [...captured].sort((a, b) => a - b)) {
        for (const kind of kinds) {
          offsets.push({ layer: l, kind, byteOffset });
          byteOffset += count * widths[kind] * 4;
        }
      }
      runner.submit({
        label: 'fidelity.capture',
        seq,
        position,
        ids,
        before: (encoder) => {
          for (const b of created) if (b !== staging) encoder.clearBuffer(b);
        },
        after: (encoder) => {
          for (const { layer, kind, byteOffset: at } of offsets) {
            encoder.copyBufferToBuffer(buffers[layer][kind] as GPUBuffer, 0, staging, at, count * widths[kind] * 4);
          }
        },
      });
      await staging.mapAsync(GPUMapMode.READ, 0, byteOffset);
      const data = new Float32Array(staging.getMappedRange(0, byteOffset).slice(0));
      staging.unmap();
      gpu.throwIfErrors();
      for (const { layer, kind, byteOffset: at } of offsets) {
        const floats = count * widths[kind];
        (out[layer][kind] as Float32Array).set(data.subarray(at / 4, at / 4 + floats), position * widths[kind]);
      }
      options.onProgress?.(position + count, n);
    }
    return out;
  } finally {
    pool.free(seq);
    runner.release();
    transformer.release();
    for (const b of created) gpu.allocator.release(b);
    pool.destroy();
  }
}
