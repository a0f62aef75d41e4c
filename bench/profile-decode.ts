/**
 * Where a decode step's time goes, measured on the GPU: the decode graph (forward body, logits, sampler) is recorded
 * with every PreparedDispatch in its own compute pass carrying timestamp writes, so each dispatch's GPU time is
 * end − begin of its pass. The step is replayed `--reps` times; per dispatch the median is kept, then summed by kernel
 * role (the label without its layer number). Pass boundaries serialize dispatches that a single pass might overlap a
 * little, so the sum is close to, and usually just above, the whole step's GPU time (also measured: one pass,
 * timestamps at its ends). Needs the adapter's `timestamp-query` feature.
 *
 *   npx tsx bench/profile-decode.ts --model qwen2.5-0.5b --weights q4_k_m --context 1024 [--kv int2] [--reps 5]
 *     [--tokens 128 [--prefill-matmul auto|f32] [--prefill-attention auto|f32]]   (the prefill chunk that ends a
 *     prompt of `context` tokens; the engine is loaded with that prefill chunk, so the fill and the pool's f16 share
 *     follow it) [--ablate]   (each role's marginal cost: the step timed without its dispatches)
 *     [--steady 64]   (instead: 64 decode steps back to back as the engine runs them, after 64 untimed ones: wall
 *     time a step against its GPU time, from timestamps at each step's ends; where the two differ, the host bounds)
 *   npx tsx bench/profile-decode.ts --quick
 */

import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { acquireGpu } from '../core/gpu/device.ts';
import type { PreparedDispatch } from '../core/gpu/dispatch.ts';
import { nodeGpu, releaseNodeGpu } from '../core/gpu/node.ts';
import type { PrefillAttention } from '../runtime/engine/api-types.ts';
import type { KvMode } from '../runtime/engine/model-runner.ts';
import type { PrefillMatmul } from '../runtime/model/transformer.ts';
import { GREEDY_SAMPLING } from '../runtime/sampling/params.ts';
import { EngineRunner } from './engine-runner.ts';
import { timePasses, warmUp } from './gpu-timing.ts';
import { runAsEntry } from './machine.ts';
import { BENCH_MODELS, ensureModelFile, QUICK_MODEL, type WeightMix } from './models.ts';
import { spread } from './stats.ts';

export interface RoleTiming {
  role: string;
  dispatches: number;
  /** Sum over the role's dispatches of their median GPU time, ms. */
  ms: number;
  /**
   * With `ablate`: the whole step's GPU time (one pass) less the same step's without this role's dispatches, median
   * over the repeats, ms.
   * A dispatch timed alone pays the pass's start and drain; this is what the role adds to a step where its neighbours
   * overlap it (results are garbage without it, the timing is not).
   */
  marginalMs?: number;
}

export interface DecodeProfile {
  context: number;
  dispatches: number;
  /** The whole decode graph in one compute pass, GPU time between its two timestamps, median ms. */
  wholeStepGpuMs: number;
  /** The same on the host: submit to onSubmittedWorkDone, median ms (adds the submit and wake-up latency). */
  wholeStepHostMs: number;
  roles: RoleTiming[];
}

/**
 * The profile of one step ending at `context`: a decode step (tokens = 1), or with `tokens` > 1 the prefill chunk of
 * that many tokens (at most the engine's prefill chunk) that ends the prompt.
 */
export async function profileDecode(
  runner: EngineRunner,
  context: number,
  reps: number,
  tokens = 1,
  ablate = false,
): Promise<DecodeProfile> {
  const engine = runner.engine;
  const m = engine.loaded;
  if (!m) throw new Error('load first');
  const gpu = engine.gpu;
  if (!gpu.features.timestampQuery) throw new Error('profile-decode needs the timestamp-query feature');
  const pool = engine.pool;
  const seq = pool.createSequence();
  try {
    // Fast fill to context − tokens positions, then the step's uniforms at the last `tokens` positions.
    const chunk = m.transformer.maxTokens;
    if (tokens < 1 || tokens > chunk) throw new Error(`--tokens ${tokens}: 1..${chunk} (the prefill chunk)`);
    const first = context - tokens;
    pool.reserve(seq, context);
    for (let position = 0; position < first; position += chunk) {
      pool.writeStep(seq, position, Math.min(chunk, first - position));
    }
    const step = {
      seq,
      position: first,
      ids: new Array<number>(tokens).fill(1),
      sample: { params: GREEDY_SAMPLING, step: 0 },
    };
    m.runner.write(step);
    // A decode step right after the fill would demote the fill's last chunk's pages (the first decode step after a
    // prompt does); a steady-state step demotes none, so plan the step again once those are demoted.
    if (tokens === 1) m.runner.write(step);
    // What the step's submit records (a demotion dispatch is left out when the step demotes nothing).
    const all: PreparedDispatch[] = m.runner.dispatches(tokens, true).filter((d) => !d.idle?.());

    await warmUp(() => timePasses(gpu, [all]));
    const whole: number[] = [];
    const host: number[] = [];
    const perDispatch: number[][] = all.map(() => []);
    for (let r = 0; r < reps; r++) {
      const start = performance.now();
      whole.push((await timePasses(gpu, [all]))[0]);
      host.push(performance.now() - start);
      const times = await timePasses(
        gpu,
        all.map((d) => [d]),
      );
      for (const [i, ms] of times.entries()) perDispatch[i].push(ms);
    }
    const roleOf = (d: PreparedDispatch) => d.label.replace(/^blk\.\d+\./, '').replace(/layer\d+\./, 'layerN.');
    const roles = new Map<string, RoleTiming>();
    all.forEach((d, i) => {
      const role = roleOf(d);
      const entry = roles.get(role) ?? { role, dispatches: 0, ms: 0 };
      entry.dispatches += 1;
      entry.ms += spread(perDispatch[i]).median;
      roles.set(role, entry);
    });
    const wholeStepGpuMs = spread(whole).median;
    if (ablate) {
      for (const entry of roles.values()) {
        // The step with and without the role back to back in one submit, so a change of clocks between submits
        // (one call measured a whole step at 37 ms, 3.5× its usual) falls on both.
        const rest = all.filter((d) => roleOf(d) !== entry.role);
        const differences: number[] = [];
        for (let r = 0; r < reps; r++) {
          const [withIt, without] = await timePasses(gpu, [all, rest]);
          differences.push(withIt - without);
        }
        entry.marginalMs = spread(differences).median;
      }
    }
    gpu.throwIfErrors();
    return {
      context,
      dispatches: all.length,
      wholeStepGpuMs,
      wholeStepHostMs: spread(host).median,
      roles: [...roles.values()].sort((a, b) => b.ms - a.ms),
    };
  } finally {
    pool.free(seq);
  }
}

/** Decode steps back to back as the engine runs them: what each takes on the GPU, and the host's wall time a step. */
export interface SteadyDecode {
  steps: number;
  /** Wall time a step, host: the engine's TPOT (submit of the next step, then the wait for this one's id). */
  wallMs: number;
  /** GPU time of a step's submit, first to last command (timestamps of empty passes at both ends), median. */
  gpuMs: number;
  /**
   * GPU idle between one step's end and the next one's start, median (the start stamp follows the step's page work,
   * which counts here): where it is near wallMs − gpuMs, the host bounds.
   */
  gapMs: number;
}

/**
 * `steps` decode steps ending at `context`, each fed from the last one's sampled id and submitted before the host
 * waits for that id, as ModelRunner's generation loop does (after as many untimed steps to raise the clocks). Each
 * step's submit carries an empty compute pass with a timestamp at its start and one at its end.
 */
export async function steadyDecode(runner: EngineRunner, context: number, steps: number): Promise<SteadyDecode> {
  const engine = runner.engine;
  const m = engine.loaded;
  if (!m) throw new Error('load first');
  const { gpu, pool } = engine;
  if (!gpu.features.timestampQuery) throw new Error('profile-decode needs the timestamp-query feature');
  const seq = pool.createSequence();
  const querySet = gpu.device.createQuerySet({ label: 'bench.steady', type: 'timestamp', count: 2 * steps });
  const resolved = gpu.allocator.createBuffer({
    label: 'bench.steady',
    category: 'scratch',
    size: 16 * steps,
    usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
  });
  const readback = gpu.allocator.createBuffer({
    label: 'bench.steady.readback',
    category: 'staging',
    size: 16 * steps,
    usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
  });
  try {
    const first = context - 2 * steps;
    if (first < 1) throw new Error(`--steady ${steps}: the context must exceed twice the steps`);
    pool.reserve(seq, context);
    const chunk = m.transformer.maxTokens;
    for (let position = 0; position < first; position += chunk) {
      pool.writeStep(seq, position, Math.min(chunk, first - position));
    }
    const stamp = (index: number | null, end: boolean) =>
      index === null
        ? undefined
        : (encoder: GPUCommandEncoder) =>
            encoder
              .beginComputePass({
                label: 'bench.stamp',
                timestampWrites: end
                  ? { querySet, endOfPassWriteIndex: index }
                  : { querySet, beginningOfPassWriteIndex: index },
              })
              .end();
    const run = async (from: number, count: number, timed: boolean): Promise<number> => {
      const submit = (i: number) =>
        m.runner.submit({
          seq,
          position: from + i,
          ids: i === 0 ? [1] : null,
          sample: { params: GREEDY_SAMPLING, step: i },
          before: stamp(timed ? 2 * i : null, false),
          after: stamp(timed ? 2 * i + 1 : null, true),
        });
      const start = performance.now();
      let pending = submit(0);
      for (let i = 1; i < count; i++) {
        const next = submit(i);
        await pending;
        pending = next;
      }
      await pending;
      return (performance.now() - start) / count;
    };
    await run(first, steps, false);
    const wallMs = await run(first + steps, steps, true);
    const encoder = gpu.device.createCommandEncoder({ label: 'bench.steady' });
    encoder.resolveQuerySet(querySet, 0, 2 * steps, resolved, 0);
    encoder.copyBufferToBuffer(resolved, 0, readback, 0, 16 * steps);
    gpu.device.queue.submit([encoder.finish()]);
    await readback.mapAsync(GPUMapMode.READ);
    const ticks = new BigUint64Array(readback.getMappedRange().slice(0));
    readback.unmap();
    const ms = (a: bigint, b: bigint) => Number(b - a) / 1e6;
    const busy = Array.from({ length: steps }, (_, i) => ms(ticks[2 * i], ticks[2 * i + 1]));
    const gaps = Array.from({ length: steps - 1 }, (_, i) => ms(ticks[2 * i + 1], ticks[2 * i + 2]));
    gpu.throwIfErrors();
    return { steps, wallMs, gpuMs: spread(busy).median, gapMs: spread(gaps).median };
  } finally {
    pool.free(seq);
    querySet.destroy();
    gpu.allocator.release(resolved);
    gpu.allocator.release(readback);
  }
}

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  const flag = (name: string) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? args[i + 1] : undefined;
  };
  const quick = args.includes('--quick');
  const shape = quick ? QUICK_MODEL : BENCH_MODELS.find((b) => b.id === (flag('model') ?? 'qwen2.5-0.5b'));
  if (!shape) throw new Error(`unknown --model; known: ${BENCH_MODELS.map((b) => b.id).join(', ')}`);
  const mix = (flag('weights') ?? (quick ? 'q4_0' : 'q4_k_m')) as WeightMix;
  const context = Number(flag('context') ?? (quick ? 256 : 1024));
  const reps = Number(flag('reps') ?? 3);
  const tokens = Number(flag('tokens') ?? 1);
  const ablate = args.includes('--ablate');
  const steady = flag('steady') === undefined ? 0 : Number(flag('steady'));
  const log = (line: string) => process.stderr.write(`[profile] ${line}\n`);
  const file = await ensureModelFile(shape, mix, 1, flag('models-dir') ?? join(tmpdir(), 'longtab-bench'), log);
  const gpu = await acquireGpu({ gpu: await nodeGpu() });
  const runner = new EngineRunner(gpu);
  try {
    const kv = (flag('kv') ?? 'f16') as KvMode;
    const prefillMatmul = (flag('prefill-matmul') ?? 'auto') as PrefillMatmul;
    const prefillAttention = (flag('prefill-attention') ?? 'auto') as PrefillAttention;
    // A chunk of `tokens` needs graphs of that size: the engine is loaded with that prefill chunk (any size, so a
    // profile of 64 tokens also fills in chunks of 64).
    const chunk = tokens > 1 ? tokens : undefined;
    const loaded = await runner.load(file, kv, context, chunk, { prefillMatmul, prefillAttention });
    if (!loaded.available) throw new Error(`kv ${kv} is not available: ${loaded.reason}`);
    if (steady > 0) {
      const d = await steadyDecode(runner, context, steady);
      process.stdout.write(
        `${shape.name} ${mix}, KV ${kv}, context ${context}, ${d.steps} decode steps back to back: wall ${d.wallMs.toFixed(3)} ms a step, GPU ${d.gpuMs.toFixed(3)} ms a step, GPU idle between steps ${d.gapMs.toFixed(3)} ms (medians), adapter ${gpu.adapter.description || gpu.adapter.device}\n`,
      );
      return;
    }
    const p = await profileDecode(runner, context, reps, tokens, ablate);
    const total = p.roles.reduce((s, r) => s + r.ms, 0);
    const lines = [
      `${shape.name} ${mix}, KV ${kv}, context ${context}, ${tokens === 1 ? 'decode step' : `prefill chunk of ${tokens} tokens, ${prefillMatmul} matmuls, ${prefillAttention} attention`}, adapter ${gpu.adapter.description || gpu.adapter.device}`,
      `${tokens === 1 ? 'decode' : 'prefill'} graph: ${p.dispatches} dispatches; whole step in one pass: GPU ${p.wholeStepGpuMs.toFixed(3)} ms, host ${p.wholeStepHostMs.toFixed(3)} ms; sum of per-dispatch GPU times ${total.toFixed(3)} ms`,
      '',
      `| role | dispatches | ms | share |${ablate ? ' step without it, ms less |' : ''}`,
      `| --- | ---: | ---: | ---: |${ablate ? ' ---: |' : ''}`,
      ...p.roles.map(
        (r) =>
          `| ${r.role} | ${r.dispatches} | ${r.ms.toFixed(3)} | ${((100 * r.ms) / Math.max(total, 1e-9)).toFixed(1)}% |${ablate ? ` ${r.marginalMs?.toFixed(3)} |` : ''}`,
      ),
    ];
    process.stdout.write(`${lines.join('\n')}\n`);
  } finally {
    await runner.unload();
    gpu.destroy();
    releaseNodeGpu();
  }
}

runAsEntry(import.meta.url, main);
