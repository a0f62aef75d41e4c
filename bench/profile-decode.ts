/**
 * Where a decode step's time goes: every PreparedDispatch of the decode graph (forward body, logits, sampler) is
 * submitted alone and waited for, `--reps` times, and the medians are summed by kernel role (the label without its
 * layer number). Each lone submit also pays a submit + wait round trip, measured separately (an empty submit) and
 * subtracted. The sum is an upper bound on the kernels' share of a real step (one submit, no waits in between).
 *
 *   npx tsx bench/profile-decode.ts --model qwen2.5-0.5b --weights q4_k_m --context 1024 [--kv int2] [--reps 5]
 *   npx tsx bench/profile-decode.ts --quick
 */
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import type { PreparedDispatch } from '../kernels/dispatch.ts';
import { encodeDispatches } from '../kernels/dispatch.ts';
import type { KvMode } from '../runtime/engine/engine.ts';
import { acquireGpu } from '../runtime/gpu/device.ts';
import { nodeGpu, releaseNodeGpu } from '../runtime/gpu/node.ts';
import { GREEDY_SAMPLING } from '../runtime/sampling/params.ts';
import { EngineRunner } from './engine-runner.ts';
import { BENCH_MODELS, ensureModelFile, QUICK_MODEL, type WeightMix } from './models.ts';
import { spread } from './stats.ts';

export interface RoleTiming {
  role: string;
  dispatches: number;
  /** Sum over the role's dispatches of (median lone-submit time − empty round trip), ms. */
  ms: number;
}

export interface DecodeProfile {
  context: number;
  dispatches: number;
  /** One empty submit + onSubmittedWorkDone, median ms. */
  roundTripMs: number;
  /** The whole decode graph in one submit, median ms (what the bench's TPOT pays minus the readback). */
  wholeStepMs: number;
  roles: RoleTiming[];
}

export async function profileDecode(runner: EngineRunner, context: number, reps: number): Promise<DecodeProfile> {
  const engine = runner.engine;
  const m = engine.loaded;
  if (!m) throw new Error('load first');
  const { device } = engine.gpu;
  const pool = engine.pool;
  const seq = pool.createSequence();
  try {
    // Fast fill to context − 1 positions, then one decode step's uniforms at the last position.
    const chunk = m.transformer.maxTokens;
    pool.reserve(seq, context);
    for (let position = 0; position < context - 1; position += chunk) {
      pool.writeStep(seq, position, Math.min(chunk, context - 1 - position));
    }
    pool.writeStep(seq, context - 1, 1);
    m.transformer.writeStep([1], context - 1);
    m.sampler.setParams(GREEDY_SAMPLING, 0);
    const graph = m.transformer.graph(1);
    const all: PreparedDispatch[] = [...graph.body, ...graph.logits, ...(m.sampler.dispatches as PreparedDispatch[])];

    const time = async (dispatches: readonly PreparedDispatch[]): Promise<number> => {
      const start = performance.now();
      const encoder = device.createCommandEncoder({ label: 'profile' });
      if (dispatches.length > 0) {
        const pass = encoder.beginComputePass({ label: 'profile' });
        encodeDispatches(pass, dispatches);
        pass.end();
      }
      device.queue.submit([encoder.finish()]);
      await device.queue.onSubmittedWorkDone();
      return performance.now() - start;
    };
    await time(all); // warm-up
    const median = async (dispatches: readonly PreparedDispatch[]) => {
      const samples: number[] = [];
      for (let r = 0; r < reps; r++) samples.push(await time(dispatches));
      return spread(samples).median;
    };
    const roundTripMs = await median([]);
    const wholeStepMs = await median(all);
    const roles = new Map<string, RoleTiming>();
    for (const d of all) {
      const ms = Math.max(0, (await median([d])) - roundTripMs);
      const role = d.label.replace(/^blk\.\d+\./, '').replace(/layer\d+\./, 'layerN.');
      const entry = roles.get(role) ?? { role, dispatches: 0, ms: 0 };
      entry.dispatches += 1;
      entry.ms += ms;
      roles.set(role, entry);
    }
    engine.gpu.throwIfErrors();
    return {
      context,
      dispatches: all.length,
      roundTripMs,
      wholeStepMs,
      roles: [...roles.values()].sort((a, b) => b.ms - a.ms),
    };
  } finally {
    pool.free(seq);
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
  const log = (line: string) => process.stderr.write(`[profile] ${line}\n`);
  const file = await ensureModelFile(shape, mix, 1, flag('models-dir') ?? join(tmpdir(), 'longtab-bench'), log);
  const gpu = await acquireGpu({ gpu: await nodeGpu() });
  const runner = new EngineRunner(gpu);
  try {
    const kv = (flag('kv') ?? 'f16') as KvMode;
    const loaded = await runner.load(file, kv, context, undefined);
    if (!loaded.available) throw new Error(`kv ${kv} is not available: ${loaded.reason}`);
    const p = await profileDecode(runner, context, reps);
    const total = p.roles.reduce((s, r) => s + r.ms, 0);
    const lines = [
      `${shape.name} ${mix}, KV ${kv}, context ${context}, adapter ${gpu.adapter.description || gpu.adapter.device}`,
      `decode graph: ${p.dispatches} dispatches; whole step in one submit ${p.wholeStepMs.toFixed(2)} ms; empty submit round trip ${p.roundTripMs.toFixed(2)} ms; sum of lone dispatches ${total.toFixed(2)} ms`,
      '',
      '| role | dispatches | ms | share |',
      '| --- | ---: | ---: | ---: |',
      ...p.roles.map(
        (r) =>
          `| ${r.role} | ${r.dispatches} | ${r.ms.toFixed(3)} | ${((100 * r.ms) / Math.max(total, 1e-9)).toFixed(1)}% |`,
      ),
    ];
    process.stdout.write(`${lines.join('\n')}\n`);
  } finally {
    await runner.unload();
    gpu.destroy();
    releaseNodeGpu();
  }
}

const entry = process.argv[1];
if (entry && import.meta.url === pathToFileURL(entry).href) {
  main().then(
    () => process.exit(0),
    (error) => {
      process.stderr.write(`${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`);
      process.exit(1);
    },
  );
}
