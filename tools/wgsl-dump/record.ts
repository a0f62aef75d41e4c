/**
 * What the runtime compiles for a model: ModelRunner.load (its compile probes, and the decode graph its warm-up step
 * builds and runs), the prefill graph of a full chunk, and the KV promotion a rollback compiles, all on a view of the
 * device that records every compute pipeline as it is made (test/shader-hooks.ts): the labels and code are the
 * engine's own, not a copy of its choices. tools/wgsl-dump/main.ts writes them out; record.test.ts checks them
 * against an engine that loads and generates.
 *
 * Bench shapes (bench/models.ts) are loaded from a GGUF that exists only as a ByteSource: the real header, norms and
 * biases, and zero bytes for every quantized matrix (all-zero blocks are valid and decode to zeros, and no kernel's
 * code depends on weight values). Nothing is written to disk.
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { BENCH_MODELS, type BenchModelShape, planModelFile, QUICK_MODEL, type WeightMix } from '../../bench/models.ts';
import type { ByteSource } from '../../core/gguf-types.ts';
import type { AdapterSummary, GpuContext, GpuFeatures } from '../../core/gpu/device.ts';
import { type PreparedDispatch, releaseDispatches } from '../../core/gpu/dispatch.ts';
import { prepareKvPromote } from '../../kernels/kv-demote.ts';
import { type KvMode, ModelRunner } from '../../runtime/engine/model-runner.ts';
import { sourceFromPath } from '../../runtime/gguf/node-source.ts';
import { withShaderHooks } from '../../test/shader-hooks.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';

/** Where the runtime compiles a pipeline. */
export type CompilePhase = 'load' | 'prefill' | 'rollback';

export interface RecordedPipeline {
  /** The label its kernel gave computePipeline; 'probe' for a load-time compile check (never dispatched). */
  label: string;
  entryPoint: string;
  code: string;
  phase: CompilePhase;
  /** Labels of the dispatches that bind it, in the order first seen. */
  dispatches: string[];
}

export interface PipelineRecord {
  model: string;
  kv: KvMode;
  /** Tokens per prefill step (the prefill graph's size), as ModelRunner.load chose it. */
  prefillChunk: number;
  /** The KV budget asked for (the engine's default when absent): with tensor cores it bounds the prefill chunk. */
  kvBudgetBytes?: number;
  adapter: AdapterSummary;
  features: GpuFeatures;
  /** One per distinct (label, entry point, code), in compile order. */
  pipelines: RecordedPipeline[];
  seconds: number;
}

const DEMO_MODEL_PATH = join('public', 'models', 'longtab-demo.gguf');
/** The demo model in this checkout. */
export const DEMO_MODEL = join(import.meta.dirname, '..', '..', DEMO_MODEL_PATH);

/** The model names --model takes besides a .gguf path: the demo model, stories260K and the bench shapes. */
export const MODEL_NAMES = ['demo', 'stories260K', QUICK_MODEL.id, ...BENCH_MODELS.map((s) => s.id)] as const;

/**
 * A bench shape's GGUF as a ByteSource (bench/models.ts plans it): the header and the F32 vectors as the bench file
 * has them, zeros for the quantized matrices.
 */
export function zeroWeightSource(shape: BenchModelShape, mix: WeightMix): ByteSource {
  const { layout, tensors } = planModelFile(shape, mix, 1);
  const pieces: { offset: number; bytes: Uint8Array }[] = [{ offset: 0, bytes: layout.header }];
  tensors.forEach((t, i) => {
    if (t.values) {
      const bytes = new Uint8Array(t.values.buffer, t.values.byteOffset, t.values.byteLength);
      pieces.push({ offset: layout.tensorOffsets[i], bytes });
    }
  });
  return {
    name: `${shape.id}-${mix} (zero matrices)`,
    size: layout.fileSize,
    async read(offset, length) {
      const out = new Uint8Array(length);
      for (const { offset: at, bytes } of pieces) {
        const from = Math.max(offset, at);
        const to = Math.min(offset + length, at + bytes.byteLength);
        if (from < to) out.set(bytes.subarray(from - at, to - at), from - offset);
      }
      return out;
    },
  };
}

/** The source a --model value names (a MODEL_NAMES entry or a .gguf path). */
export async function modelSource(model: string, mix: WeightMix): Promise<ByteSource> {
  // Bundled (tools/gpu-kit/build.mjs), this file is not in the checkout: the demo model is found from the working
  // directory, the checkout's root on the GPU host.
  if (model === 'demo') return sourceFromPath(existsSync(DEMO_MODEL) ? DEMO_MODEL : DEMO_MODEL_PATH);
  if (model === 'stories260K') {
    const path = sharedPath(STORIES260K);
    if (!path) throw new Error(`stories260K is not in the shared folder (${STORIES260K})`);
    return sourceFromPath(path);
  }
  const shape = [QUICK_MODEL, ...BENCH_MODELS].find((s) => s.id === model);
  if (shape) return zeroWeightSource(shape, mix);
  if (model.endsWith('.gguf') && existsSync(model)) return sourceFromPath(model);
  throw new Error(`--model ${model}: use ${MODEL_NAMES.join(', ')} or the path of a .gguf file`);
}

/**
 * `gpu` whose compute passes report each dispatch's pipeline and bind group label: how the sampler's dispatches,
 * which no graph exposes, are found (from the warm-up step).
 */
function reportingDispatches(gpu: GpuContext, onDispatch: (pipeline: GPUComputePipeline, label: string) => void) {
  const bound = <T extends object>(target: T, replace: Partial<Record<PropertyKey, unknown>>): T =>
    new Proxy(target, {
      get(real, property) {
        if (property in replace) return replace[property];
        const value = Reflect.get(real, property, real);
        return typeof value === 'function' ? value.bind(real) : value;
      },
    });
  const pass = (real: GPUComputePassEncoder): GPUComputePassEncoder => {
    let pipeline: GPUComputePipeline | null = null;
    return bound(real, {
      setPipeline(p: GPUComputePipeline) {
        pipeline = p;
        real.setPipeline(p);
      },
      setBindGroup(...args: [number, GPUBindGroup | null, ...unknown[]]) {
        if (pipeline && args[0] === 0 && args[1]) onDispatch(pipeline, args[1].label);
        Reflect.apply(real.setBindGroup, real, args);
      },
    });
  };
  const encoder = (real: GPUCommandEncoder): GPUCommandEncoder =>
    bound(real, { beginComputePass: (d?: GPUComputePassDescriptor) => pass(real.beginComputePass(d)) });
  const device = bound(gpu.device, {
    createCommandEncoder: (d?: GPUCommandEncoderDescriptor) => encoder(gpu.device.createCommandEncoder(d)),
  });
  return Object.assign(Object.create(gpu) as GpuContext, { device });
}

/** Loads `source` in an engine on a recording view of `gpu` and returns every pipeline it compiled, then unloads. */
export async function recordPipelines(
  gpu: GpuContext,
  source: ByteSource,
  options: { model: string; kv: KvMode; prefillChunk?: number; kvBudgetBytes?: number },
): Promise<PipelineRecord> {
  const started = performance.now();
  const byKey = new Map<string, RecordedPipeline>();
  const byPipeline = new Map<GPUComputePipeline, RecordedPipeline>();
  let phase: CompilePhase = 'load';
  const hooked = withShaderHooks(gpu, {
    pipeline(pipeline, made) {
      const key = `${made.label}\u0000${made.entryPoint}\u0000${made.code}`;
      let entry = byKey.get(key);
      if (!entry) byKey.set(key, (entry = { ...made, phase, dispatches: [] }));
      byPipeline.set(pipeline, entry);
    },
  });
  const dispatched = (pipeline: GPUComputePipeline, label: string) => {
    const entry = byPipeline.get(pipeline);
    if (entry && !entry.dispatches.includes(label)) entry.dispatches.push(label);
  };
  const seen = (dispatches: readonly PreparedDispatch[]) => {
    for (const d of dispatches) dispatched(d.pipeline, d.label);
  };
  const view = reportingDispatches(hooked, dispatched);
  const engine = new ModelRunner(view);
  const { kv, prefillChunk, kvBudgetBytes } = options;
  await engine.load(source, {
    kv,
    ...(prefillChunk ? { prefillChunk } : {}),
    ...(kvBudgetBytes ? { kvBudgetBytes } : {}),
  });
  try {
    const m = engine.loaded!;
    const chunk = m.transformer.maxTokens;
    phase = 'prefill';
    // Built as a prefill step of a full chunk builds it (Transformer.encode); graph(1) is the warm-up's.
    for (const tokens of new Set([1, chunk])) {
      const g = m.transformer.graph(tokens);
      seen(g.body);
      seen(g.logits);
    }
    if (m.pool.quant) {
      // pool.ts compiles the promotion when a rollback rewrites a quantized page (rewritePages): the same call.
      phase = 'rollback';
      const promote = prepareKvPromote(view, 'kv.promote', m.pool, []);
      seen(promote);
      releaseDispatches(view, promote);
    }
    await gpu.device.queue.onSubmittedWorkDone();
    gpu.throwIfErrors();
    return {
      model: options.model,
      kv,
      prefillChunk: chunk,
      ...(kvBudgetBytes ? { kvBudgetBytes } : {}),
      adapter: gpu.adapter,
      features: gpu.features,
      pipelines: [...byKey.values()],
      seconds: (performance.now() - started) / 1000,
    };
  } finally {
    engine.unload();
  }
}
