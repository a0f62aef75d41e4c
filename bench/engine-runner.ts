/**
 * longtab's engine on one GGUF file and one KV mode: loads it once with a KV budget for the largest context, then
 * measures each context (see BENCH.md for the protocol). Decode steps go through `generateInSequence`, the product's
 * own path (one submit and one 4-byte readback per token), timed on the host between consecutive tokens.
 */

import { InvalidRequestError } from '../core/errors.ts';
import type { ByteSource } from '../core/gguf-types.ts';
import type { MemorySnapshot } from '../core/gpu/allocator.ts';
import { acquireGpu, type GpuContext } from '../core/gpu/device.ts';
import { nodeGpu, releaseNodeGpu } from '../core/gpu/node.ts';
import type { PrefillAttention } from '../runtime/engine/api-types.ts';
import { planStats } from '../runtime/engine/kv-stats.ts';
import { parseLoadOptions } from '../runtime/engine/load-options.ts';
import { type KvMode, ModelRunner } from '../runtime/engine/model-runner.ts';
import { sourceFromPath } from '../runtime/gguf/node-source.ts';
import type { TokenConstraint } from '../runtime/grammar/constraint.ts';
import { defaultQuantF16Bytes } from '../runtime/kv/pool.ts';
import type { RotationCache } from '../runtime/kv/rotation-store.ts';
import type { PrefillMatmul } from '../runtime/model/transformer.ts';
import { adapterSlug, sourceCommit } from './machine.ts';
import { type BenchModelFile, benchModelNamed, ensureModelFile, type WeightMix } from './models.ts';
import { type RowTiming, summarize, type TimedRepeat } from './stats.ts';

export type FillMode = 'prefill' | 'fast';

export interface DecodeGraphCounts {
  /** PreparedDispatches recorded per decode token: forward body + logits + sampler. */
  dispatches: number;
  forwardDispatches: number;
  logitsDispatches: number;
  samplerDispatches: number;
  /** Compute passes per decode token (forward, logits, sample). */
  computePasses: number;
  /** Measured by counting queue calls over the timed decode steps, divided by the steps. */
  submitsPerToken: number;
  writeBuffersPerToken: number;
}

export interface EngineRowResult {
  fill: FillMode;
  promptTokens: number;
  timing: RowTiming;
  /** Every timed decode step's wall time, repeat after repeat. */
  stepMs: number[];
  /** Measured from the pool after the run: bytes of pages the sequence holds / its length. */
  kvBytesPerToken: number;
  memory: MemorySnapshot;
  kvPool: { bytesUsed: number; bytesReserved: number; slabs: number; pageTokens: number; pageBytes: number };
  graph: DecodeGraphCounts;
  /** The quant cache's precision plan (stats().kv.plan); null for an f16 cache. */
  kvPlan: { summary: string; source: string; bitsPerElementAt32K: number } | null;
  /** Weights read per decode token (every matrix once; the embedding one row unless tied to the output). */
  weightBytesReadPerToken: number;
  /** KV bytes read per decode token at the mean decode position. */
  kvBytesReadPerToken: number;
}

export interface EngineLoadResult {
  available: boolean;
  /** Why the mode is not available (the engine's own error message). */
  reason?: string;
  loadSeconds?: number;
}

/** Counts submits and writeBuffers on a queue while `active` (patched in place; `restore()` puts them back). */
function countQueueCalls(queue: GPUQueue) {
  const counts = { submits: 0, writeBuffers: 0 };
  const submit = queue.submit;
  const writeBuffer = queue.writeBuffer;
  const patched = queue as unknown as Record<string, unknown>;
  patched.submit = function (this: GPUQueue, ...args: Parameters<GPUQueue['submit']>) {
    counts.submits++;
    return submit.apply(this, args);
  };
  patched.writeBuffer = function (this: GPUQueue, ...args: Parameters<GPUQueue['writeBuffer']>) {
    counts.writeBuffers++;
    return writeBuffer.apply(this, args);
  };
  return {
    counts,
    restore() {
      delete patched.submit;
      delete patched.writeBuffer;
      if (queue.submit !== submit) patched.submit = submit;
      if (queue.writeBuffer !== writeBuffer) patched.writeBuffer = writeBuffer;
    },
  };
}

/**
 * The KV budget a bench load takes: room for the largest context plus page rounding. int2: the pool gives at most half
 * the budget to f16 pages and takes the largest prefill chunk whose f16 pages (sink + window + the chunk, for two
 * sequences) that half holds (defaultPrefillChunk); twice those pages for 1024-token chunks keeps short contexts on the
 * chunk long ones take. (4096 f16 tokens' worth, the earlier margin, left every model's 1K rows on 512-token chunks:
 * Qwen3-4B's 410 MB of f16 pages against a 382 MB half.) Quant pages are smaller, so the rest is plenty.
 */
export function benchKvBudgetBytes(
  shape: { layers: number; kvHeads: number; headDim: number },
  kv: KvMode,
  maxContext: number,
): number {
  const { layers, kvHeads, headDim } = shape;
  const f16BytesPerToken = 2 * layers * kvHeads * headDim * 2;
  const f16Pages =
    kv === 'int2'
      ? defaultQuantF16Bytes({
          layers,
          kvHeads,
          headDim,
          budgetBytes: 0,
          kv: 'quant',
          maxSequences: 2,
          maxStepTokens: 1024,
        })
      : 0;
  return f16BytesPerToken * (maxContext + 64) + 2 * f16Pages;
}

function planOf(m: NonNullable<ModelRunner['loaded']>): EngineRowResult['kvPlan'] {
  const plan = planStats(m.pool, m.kv.options);
  return plan ? { summary: plan.summary, source: plan.source, bitsPerElementAt32K: plan.bitsPerElementAt32K } : null;
}

export class EngineRunner {
  readonly engine: ModelRunner;
  private source: ByteSource | null = null;
  private file: BenchModelFile | null = null;

  constructor(gpu: GpuContext) {
    this.engine = new ModelRunner(gpu);
  }

  get gpu(): GpuContext {
    return this.engine.gpu;
  }

  /** Loads `file` with `kv`; an unavailable KV mode is reported, not thrown. */
  async load(
    file: BenchModelFile,
    kv: KvMode,
    maxContext: number,
    prefillChunk: number | undefined,
    kernels: { prefillMatmul?: PrefillMatmul; prefillAttention?: PrefillAttention } = {},
    /** Where calibrated rotations are found (with them, int2 runs the calibration's rotations and plan). */
    rotationCache?: RotationCache,
  ): Promise<EngineLoadResult> {
    await this.unload();
    const s = file.shape;
    const started = performance.now();
    this.source = await sourceFromPath(file.path);
    try {
      await this.engine.load(this.source, {
        ...parseLoadOptions({
          kv,
          kvBudgetBytes: benchKvBudgetBytes(s, kv, maxContext),
          maxSequences: 2,
          ...(prefillChunk ? { prefillChunk } : {}),
          experimental: kernels,
        }),
        ...(rotationCache ? { rotationCache } : {}),
      });
    } catch (error) {
      await this.unload();
      if (error instanceof InvalidRequestError && error.details.field === 'kv') {
        return { available: false, reason: error.message };
      }
      throw error;
    }
    this.file = file;
    return { available: true, loadSeconds: (performance.now() - started) / 1000 };
  }

  async unload(): Promise<void> {
    this.engine.unload();
    await this.source?.close?.();
    this.source = null;
    this.file = null;
  }

  get prefillChunk(): number {
    return this.engine.loaded?.transformer.maxTokens ?? 0;
  }

  /**
   * The decode graph's size, from the Transformer's recorded dispatches and the sampler, on a step that demotes no KV
   * page (the demotion dispatches run on the others only: one decode step in pageTokens).
   */
  decodeGraph(): Omit<DecodeGraphCounts, 'submitsPerToken' | 'writeBuffersPerToken'> {
    const m = this.engine.loaded;
    if (!m) throw new Error('load first');
    const g = m.transformer.graph(1);
    const body = g.body.filter((d) => !d.idle).length;
    const samplerDispatches = m.runner.samplerDispatches;
    return {
      dispatches: body + g.logits.length + samplerDispatches,
      forwardDispatches: body,
      logitsDispatches: g.logits.length,
      samplerDispatches,
      computePasses: 3,
    };
  }

  /** One context: warm-up, then up to `repeats` timed runs within `budgetMs`. */
  async measure(request: {
    context: number;
    decodeSteps: number;
    repeats: number;
    fill: FillMode;
    budgetMs: number;
    promptIds: number[];
    /** A response format's constraint for each run (constrained decode); absent = plain text. */
    constraint?: () => Promise<TokenConstraint>;
  }): Promise<EngineRowResult> {
    const m = this.engine.loaded;
    if (!m || !this.file) throw new Error('load first');
    const { decodeSteps, fill, promptIds } = request;
    const prompt = promptIds.length;
    const pool = this.engine.pool;
    const chunk = m.transformer.maxTokens;

    const runOnce = async (ids: number[], tokens: number, mode: FillMode, counting: boolean) => {
      const seq = pool.createSequence();
      let constraint: TokenConstraint | undefined;
      try {
        let reuseTokens = 0;
        if (mode === 'fast') {
          // Timing-only fill: pages for the prompt are reserved and the sequence advanced chunk by chunk, as a prefill
          // would, but nothing is submitted: K/V are never computed (the pages hold zeros or stale values), while
          // attention reads the same bytes and does the same arithmetic.
          // The last sampled token is never fed back: ids.length + tokens - 1 positions (= the context) are written.
          pool.reserve(seq, ids.length + tokens - 1);
          for (let position = 0; position < ids.length - 1; position += chunk) {
            pool.writeStep(seq, position, Math.min(chunk, ids.length - 1 - position));
          }
          reuseTokens = ids.length - 1;
        }
        constraint = await request.constraint?.();
        const stamps: number[] = [];
        let counter: ReturnType<typeof countQueueCalls> | null = null;
        let countedFrom = { submits: 0, writeBuffers: 0 };
        const result = await this.engine.generateInSequence(seq, {
          promptIds: ids,
          reuseTokens,
          maxTokens: tokens,
          stopAtEog: false,
          sampling: { temperature: 0 },
          constraint,
          onToken: () => {
            stamps.push(performance.now());
            if (counting && stamps.length === 1) {
              counter = countQueueCalls(this.engine.gpu.device.queue);
              countedFrom = { ...counter.counts };
            }
            return undefined;
          },
        });
        const counted = counter as ReturnType<typeof countQueueCalls> | null;
        counted?.restore();
        const steps = Math.max(stamps.length - 1, 1);
        const calls = counted
          ? {
              submitsPerToken: (counted.counts.submits - countedFrom.submits) / steps,
              writeBuffersPerToken: (counted.counts.writeBuffers - countedFrom.writeBuffers) / steps,
            }
          : null;
        const stepMs: number[] = [];
        for (let i = 1; i < stamps.length; i++) stepMs.push(stamps[i] - stamps[i - 1]);
        const repeat: TimedRepeat = {
          promptTokens: ids.length - reuseTokens,
          ttftMs: result.usage.ttftMs,
          prefillTokensPerSecond: result.usage.prefillTokensPerSecond,
          stepMs,
        };
        const stats = pool.stats();
        return { repeat, calls, seqLength: seq.length, stats, memory: this.engine.memory() };
      } finally {
        constraint?.dispose();
        pool.free(seq);
      }
    };

    // Warm-up: every graph size the timed runs use (full chunks, the remainder chunk, one token) and a few steps.
    const warmupLength = fill === 'fast' || prompt <= chunk ? prompt : chunk + (prompt % chunk);
    await runOnce(promptIds.slice(0, warmupLength), Math.min(4, decodeSteps + 1), fill, false);

    const repeats: TimedRepeat[] = [];
    let last: Awaited<ReturnType<typeof runOnce>> | null = null;
    let calls: { submitsPerToken: number; writeBuffersPerToken: number } | null = null;
    const started = performance.now();
    for (let r = 0; r < request.repeats; r++) {
      last = await runOnce(promptIds, decodeSteps + 1, fill, r === 0);
      calls ??= last.calls;
      repeats.push(last.repeat);
      const perRepeat = (performance.now() - started) / repeats.length;
      if (performance.now() - started + perRepeat > request.budgetMs) break;
    }
    if (!last) throw new Error('no repeat ran');
    // f16: a page holds pageTokens positions of every layer, nothing else. int2 (quant pages): effective bytes per
    // cached position with one live sequence, used pages of both kinds (the f16 sink and window included) over its
    // length. (f16 mode reserves a page ahead, so used pages / length would overstate small contexts.)
    const kvBytesPerToken =
      last.stats.mode === 'quant'
        ? last.stats.bytesUsed / Math.max(last.seqLength, 1)
        : last.stats.pageBytes / last.stats.pageTokens;
    const meanPosition = prompt + decodeSteps / 2;
    const weights = m.weights;
    const embeddingBytes = weights.embedding.byteLength;
    const weightBytesReadPerToken =
      last.memory.bytes.weights -
      (m.config.tiedOutput ? 0 : embeddingBytes) +
      (m.config.tiedOutput ? 0 : embeddingBytes / m.config.vocab);
    return {
      fill,
      promptTokens: prompt,
      timing: summarize(repeats, request.repeats, fill === 'prefill'),
      stepMs: repeats.flatMap((r) => r.stepMs),
      kvBytesPerToken,
      memory: last.memory,
      kvPool: {
        bytesUsed: last.stats.bytesUsed,
        bytesReserved: last.stats.bytesReserved,
        slabs: last.stats.slabs,
        pageTokens: last.stats.pageTokens,
        pageBytes: last.stats.pageBytes,
      },
      graph: {
        ...this.decodeGraph(),
        submitsPerToken: calls?.submitsPerToken ?? Number.NaN,
        writeBuffersPerToken: calls?.writeBuffersPerToken ?? Number.NaN,
      },
      weightBytesReadPerToken,
      kvBytesReadPerToken: kvBytesPerToken * Math.min(meanPosition, last.seqLength),
      kvPlan: planOf(m),
    };
  }
}

/** What a bench script over bench models loads: each model × weight mix × KV mode. */
export interface BenchLoads {
  models: string[];
  weights: WeightMix[];
  kv: KvMode[];
  modelsDir: string;
  log: (line: string) => void;
}

/**
 * Runs `measure` on an EngineRunner loaded with each model × weight mix × KV mode of `loads` in turn (the model file
 * generated once per mix; a mode the model refuses is logged and skipped), on a Dawn device acquired for the run and
 * released after. Returns the adapter and commit the rows were measured on.
 */
export async function forEachBenchLoad(
  loads: BenchLoads,
  maxContext: number,
  measure: (load: { model: string; weights: WeightMix; kv: KvMode; engine: EngineRunner }) => Promise<void>,
): Promise<{ adapter: GpuContext['adapter']; slug: string; commit: string }> {
  const dawn = await nodeGpu();
  const gpu = await acquireGpu({ gpu: dawn, onError: (e) => loads.log(`WebGPU error: ${e.message}`) });
  const engine = new EngineRunner(gpu);
  try {
    for (const model of loads.models) {
      const shape = benchModelNamed(model);
      for (const weights of loads.weights) {
        const file = await ensureModelFile(shape, weights, 1, loads.modelsDir, loads.log);
        for (const kv of loads.kv) {
          const loaded = await engine.load(file, kv, maxContext, undefined);
          if (!loaded.available) {
            loads.log(`${model} ${weights} ${kv}: not available: ${loaded.reason}`);
            continue;
          }
          await measure({ model, weights, kv, engine });
        }
      }
    }
  } finally {
    await engine.unload();
    gpu.destroy();
    releaseNodeGpu();
  }
  return { adapter: { ...gpu.adapter }, slug: adapterSlug(gpu), commit: sourceCommit() };
}
