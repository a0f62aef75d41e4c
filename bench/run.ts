/**
 * `npm run bench`: longtab vs native llama.cpp (node-llama-cpp) on random-weight GGUF files at real model shapes.
 * Protocol, flags and how to run it on the GPU host: BENCH.md. Results: bench/results/<date>-<adapter>.{json,md},
 * rewritten after every row so an interrupted run keeps what it measured.
 */

import { mkdir, writeFile } from 'node:fs/promises';
import { cpus, tmpdir, totalmem } from 'node:os';
import { join, resolve } from 'node:path';
import { acquireGpu } from '../core/gpu/device.ts';
import { nodeGpu, releaseNodeGpu } from '../core/gpu/node.ts';
import { ensureCalibrated } from '../runtime/cli/calibrate.ts';
import type { PrefillAttention } from '../runtime/engine/api-types.ts';
import type { KvMode } from '../runtime/engine/model-runner.ts';
import { nodeRotationCache } from '../runtime/kv/rotation-cache-node.ts';
import type { PrefillMatmul } from '../runtime/model/transformer.ts';
import { EngineRunner, type FillMode } from './engine-runner.ts';
import { type LlamaBackend, LlamaCppRunner, type LlamaKvType, llamaKvBytesPerToken } from './llama-cpp.ts';
import { adapterSlug, isCpuAdapter, runAsEntry, sourceCommit } from './machine.ts';
import {
  BENCH_MODELS,
  type BenchModelFile,
  type BenchModelShape,
  benchModelNamed,
  ensureModelFile,
  promptIds,
  QUICK_MODEL,
  WEIGHT_MIXES,
  type WeightMix,
} from './models.ts';
import { type BenchReport, type BenchRow, REPORT_SCHEMA, renderMarkdown } from './report.ts';

export interface BenchOptions {
  quick: boolean;
  /** int2 rows with the engine's calibration (rotations, clip, plan) instead of the Hadamard rotation. */
  calibrate: boolean;
  models: BenchModelShape[];
  weights: WeightMix[];
  kv: KvMode[];
  contexts: number[];
  decodeSteps: number;
  repeats: number;
  fill: 'auto' | FillMode;
  /** auto fill: prefill honestly unless the estimated prefill time of one repeat exceeds this. */
  prefillLimitSeconds: number;
  /** Per row: stop repeating when another repeat would pass this. */
  rowBudgetSeconds: number;
  /** Whole run: rows after this are marked skipped (the device tool kills a command at 600 s). */
  totalBudgetSeconds: number;
  prefillChunk: number | undefined;
  prefillMatmul: PrefillMatmul;
  prefillAttention: PrefillAttention;
  llama: 'auto' | LlamaBackend | 'off';
  llamaKv: LlamaKvType[];
  llamaThreads: number | undefined;
  llamaBatch: number;
  modelsDir: string;
  outDir: string;
  /** File name stem; default `<date>-<adapter>[-quick]`. */
  name: string | undefined;
  seed: number;
  log: (line: string) => void;
}

const QUICK_DEFAULTS = { contexts: [64, 256], decodeSteps: 8, repeats: 2 };
const FULL_DEFAULTS = { contexts: [1024, 8192, 32768, 65536, 131072], decodeSteps: 64, repeats: 5 };

const USAGE = `Usage: npm run bench -- [flags]   (or: node .gpu/bench.mjs [flags] on the GPU host)
  --quick                 tiny 2-layer model, contexts 64/256, 8 decode steps, 2 repeats
  --models ids            ${BENCH_MODELS.map((m) => m.id).join(',')} (default: all)
  --weights mixes         ${WEIGHT_MIXES.join(',')} (default: both; quick: q4_0)
  --kv modes              longtab KV modes: f16,int2 (default both; int2 rows say 'not available' until it loads)
  --contexts list         default 1024,8192,32768,65536,131072 (rows past a model's context length are skipped)
  --decode-steps n        default 64
  --repeats n             timed repeats after warm-up, default 5
  --fill auto|prefill|fast  how the KV is filled before decode (default auto, see BENCH.md)
  --prefill-limit-s s     auto fill: fast fill when one prefill is estimated to take longer (default 45)
  --row-budget-s s        per row: no further repeat past this (default 60)
  --budget-s s            whole run: later rows are skipped (default: none)
  --calibrate             int2 rows run what a user gets after the engine's calibration (rotations, clip and precision
                          plan fitted on the model's own text, cached by the model's digest), not the Hadamard rotation
  --prefill-chunk n       longtab tokens per prefill submit (default: the engine's, 128; 1024 with int8 tensor cores)
  --prefill-matmul m      auto (int8 tensor cores where the GPU has them), f32 or int8-dot (dot4I8Packed; default auto)
  --prefill-attention m   auto (q·k and p·v on int8 tensor cores where the GPU has them), f32 or int8-dot
                          (the same on dot4I8Packed; default auto)
  --llama auto|vulkan|cpu|off   node-llama-cpp backend (auto: vulkan on a GPU adapter, cpu on a CPU one)
  --llama-kv types        f16,q4_0 (default both)
  --llama-threads n       default 1 on cpu (2-core dev machines), 8 with vulkan
  --llama-batch n         llama.cpp batch size (default 512)
  --models-dir dir        cache of generated GGUF files (default $TMPDIR/longtab-bench)
  --out dir               default bench/results
  --name stem             output file stem (default <date>-<adapter>[-<models> when not all][-quick])
  --seed n                default 1`;

function list(value: string): string[] {
  return value
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
}

function intList(value: string): number[] {
  return list(value).map((s) => {
    const n = Number(s.replace(/k$/i, '')) * (/k$/i.test(s) ? 1024 : 1);
    if (!Number.isInteger(n) || n < 2) throw new Error(`not a context size: ${s}`);
    return n;
  });
}

export function parseBenchArgs(argv: readonly string[], log: (line: string) => void): BenchOptions {
  const flags = new Map<string, string>();
  let quick = false;
  let calibrate = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '--quick') quick = true;
    else if (arg === '--calibrate') calibrate = true;
    else if (arg === '--help' || arg === '-h') {
      console.log(USAGE);
      process.exit(0);
    } else if (arg.startsWith('--')) {
      const [key, inline] = arg.slice(2).split('=', 2);
      const value = inline ?? argv[++i];
      if (value === undefined) throw new Error(`--${key} needs a value\n${USAGE}`);
      flags.set(key, value);
    } else throw new Error(`unexpected argument ${arg}\n${USAGE}`);
  }
  const defaults = quick ? QUICK_DEFAULTS : FULL_DEFAULTS;
  const take = (key: string) => {
    const v = flags.get(key);
    flags.delete(key);
    return v;
  };
  const num = (key: string, fallback: number) => {
    const v = take(key);
    if (v === undefined) return fallback;
    const n = Number(v);
    if (!Number.isFinite(n) || n < 0) throw new Error(`--${key} ${v} is not a number`);
    return n;
  };
  const modelIds = take('models');
  const models = quick ? [QUICK_MODEL] : modelIds ? list(modelIds).map(benchModelNamed) : [...BENCH_MODELS];
  const weights = list(take('weights') ?? (quick ? 'q4_0' : WEIGHT_MIXES.join(','))) as WeightMix[];
  for (const w of weights) if (!WEIGHT_MIXES.includes(w)) throw new Error(`unknown weight mix ${w}`);
  const kv = list(take('kv') ?? 'f16,int2') as KvMode[];
  const llamaKv = list(take('llama-kv') ?? 'f16,q4_0') as LlamaKvType[];
  const fill = (take('fill') ?? 'auto') as BenchOptions['fill'];
  if (!['auto', 'prefill', 'fast'].includes(fill)) throw new Error(`--fill ${fill}: auto, prefill or fast`);
  const llama = (take('llama') ?? 'auto') as BenchOptions['llama'];
  if (!['auto', 'vulkan', 'cpu', 'off'].includes(llama)) throw new Error(`--llama ${llama}: auto, vulkan, cpu or off`);
  const contexts = take('contexts');
  const threads = take('llama-threads');
  const chunk = take('prefill-chunk');
  const prefillMatmul = (take('prefill-matmul') ?? 'auto') as BenchOptions['prefillMatmul'];
  if (!['auto', 'f32', 'int8-dot'].includes(prefillMatmul)) {
    throw new Error(`--prefill-matmul ${prefillMatmul}: auto, f32 or int8-dot`);
  }
  const prefillAttention = (take('prefill-attention') ?? 'auto') as BenchOptions['prefillAttention'];
  if (!['auto', 'f32', 'int8-dot'].includes(prefillAttention)) {
    throw new Error(`--prefill-attention ${prefillAttention}: auto, f32 or int8-dot`);
  }
  const options: BenchOptions = {
    quick,
    calibrate,
    models,
    weights,
    kv,
    contexts: contexts ? intList(contexts) : defaults.contexts,
    decodeSteps: num('decode-steps', defaults.decodeSteps),
    repeats: Math.max(1, num('repeats', defaults.repeats)),
    fill,
    prefillLimitSeconds: num('prefill-limit-s', 45),
    rowBudgetSeconds: num('row-budget-s', 60),
    totalBudgetSeconds: num('budget-s', Number.POSITIVE_INFINITY),
    prefillChunk: chunk ? Number(chunk) : undefined,
    prefillMatmul,
    prefillAttention,
    llama,
    llamaKv,
    llamaThreads: threads ? Number(threads) : undefined,
    llamaBatch: num('llama-batch', 512),
    modelsDir: take('models-dir') ?? join(tmpdir(), 'longtab-bench'),
    outDir: take('out') ?? 'bench/results',
    name: take('name'),
    seed: num('seed', 1),
    log,
  };
  if (flags.size > 0) throw new Error(`unknown flags: ${[...flags.keys()].join(', ')}\n${USAGE}`);
  for (const c of options.contexts) {
    if (c <= options.decodeSteps + 1) throw new Error(`context ${c} must exceed decode steps + 1`);
  }
  return options;
}

function bytesRead(file: BenchModelFile, kvBytesPerToken: number, meanPosition: number) {
  // Every matrix is read once per token; the embedding one row, unless it is also the output projection.
  let weights = 0;
  for (const [name, bytes] of Object.entries(file.tensorBytes)) {
    if (name === 'token_embd.weight' && !file.shape.tiedOutput) weights += bytes / file.shape.vocab;
    else weights += bytes;
  }
  const kv = kvBytesPerToken * meanPosition;
  return { weights, kv, total: weights + kv };
}

export async function runBench(
  options: BenchOptions,
): Promise<{ report: BenchReport; jsonPath: string; mdPath: string }> {
  const log = options.log;
  const started = performance.now();
  const overBudget = () => (performance.now() - started) / 1000 > options.totalBudgetSeconds;
  const dawn = await nodeGpu();
  const rawAdapter = await dawn.requestAdapter();
  const gpu = await acquireGpu({
    gpu: dawn,
    onError: (e) => log(`WebGPU error: ${e.message}`),
  });
  const adapterLimits: Record<string, number> = {};
  if (rawAdapter) {
    for (const key in rawAdapter.limits) {
      const v = (rawAdapter.limits as unknown as Record<string, unknown>)[key];
      if (typeof v === 'number') adapterLimits[key] = v;
    }
  }
  const date = new Date();
  const subset = !options.quick && options.models.length < BENCH_MODELS.length;
  const name =
    options.name ??
    [
      date.toISOString().slice(0, 10),
      adapterSlug(gpu),
      ...(subset ? [options.models.map((m) => m.id).join('_')] : []),
      ...(options.quick ? ['quick'] : []),
    ].join('-');
  await mkdir(options.outDir, { recursive: true });
  const jsonPath = resolve(options.outDir, `${name}.json`);
  const mdPath = resolve(options.outDir, `${name}.md`);
  const cpuAdapter = isCpuAdapter(gpu);
  const llamaBackend: LlamaBackend | 'off' = options.llama === 'auto' ? (cpuAdapter ? 'cpu' : 'vulkan') : options.llama;
  const llamaThreads = options.llamaThreads ?? (llamaBackend === 'cpu' ? 1 : 8);

  const report: BenchReport = {
    schema: REPORT_SCHEMA,
    date: date.toISOString(),
    quick: options.quick,
    finished: false,
    commit: sourceCommit(),
    host: {
      platform: process.platform,
      arch: process.arch,
      cpus: cpus().length,
      cpuModel: cpus()[0]?.model ?? 'unknown',
      node: process.version,
      memoryBytes: totalmem(),
    },
    adapter: {
      info: { ...gpu.adapter },
      features: rawAdapter ? [...rawAdapter.features].map(String).sort() : [],
      limits: { ...adapterLimits, ...gpu.limits },
      deviceFeatures: [...gpu.device.features].map(String).sort(),
    },
    protocol: {
      contexts: options.contexts,
      decodeSteps: options.decodeSteps,
      repeats: options.repeats,
      warmup:
        'per row, one untimed run with the same graph sizes (a prompt of one prefill chunk plus the remainder chunk) and up to 4 tokens',
      timed:
        'prefill of context − decodeSteps prompt tokens, TTFT = prefill start to the first token on the host; then decodeSteps steps, each timed from one token on the host to the next (TPOT); decode tok/s = 1000 / median TPOT',
      fill:
        options.fill === 'auto'
          ? `auto: real prefill unless its estimate (from the previous context, scaled by (ctx ratio)^1.5) exceeds ${options.prefillLimitSeconds} s, then fast fill (pages reserved, length set, no K/V computed; longtab only: llama.cpp rows are skipped instead)`
          : options.fill,
      prefillChunk: options.prefillChunk ?? null,
      prefillMatmul: options.prefillMatmul,
      prefillAttention: options.prefillAttention,
      rowBudgetSeconds: options.rowBudgetSeconds,
      prefillLimitSeconds: options.prefillLimitSeconds,
      seed: options.seed,
      calibrate: options.calibrate,
      llama:
        llamaBackend === 'off'
          ? 'off'
          : `node-llama-cpp ${llamaBackend}, all layers offloaded when vulkan, flash attention on, threads ${llamaThreads}, batch ${options.llamaBatch}, KV types ${options.llamaKv.join('/')}, same prompt ids, greedy`,
    },
    llama: { available: false, reason: 'not started' },
    models: [],
    rows: [],
    notes: [],
  };
  const save = async () => {
    await writeFile(jsonPath, `${JSON.stringify(report, null, 1)}\n`);
    await writeFile(mdPath, renderMarkdown(report));
  };

  let llama: LlamaCppRunner | null = null;
  if (llamaBackend === 'off') report.llama = { available: false, reason: '--llama off' };
  else {
    try {
      llama = await LlamaCppRunner.create({
        backend: llamaBackend,
        threads: llamaThreads,
        batchSize: options.llamaBatch,
        flashAttention: true,
        log,
      });
      report.llama = { ...llama.info, available: true };
    } catch (error) {
      report.llama = { available: false, reason: `node-llama-cpp failed to start: ${String(error)}` };
      log(report.llama.reason);
    }
  }

  const engine = new EngineRunner(gpu);
  try {
    for (const shape of options.models) {
      for (const mix of options.weights) {
        if (overBudget()) {
          report.notes.push(`run budget reached before ${shape.id} ${mix}`);
          break;
        }
        const file = await ensureModelFile(shape, mix, options.seed, options.modelsDir, log);
        report.models.push({
          id: shape.id,
          name: shape.name,
          weights: mix,
          shape: {
            layers: shape.layers,
            dim: shape.dim,
            heads: shape.heads,
            kvHeads: shape.kvHeads,
            headDim: shape.headDim,
            ffnDim: shape.ffnDim,
            vocab: shape.vocab,
          },
          fileBytes: file.bytes,
          typeCounts: file.typeCounts,
          generated: file.generated,
          generateSeconds: file.generateSeconds,
          path: file.path,
        });
        await save();
        const llamaRows = await runLlamaRows(llama, file, options, log, overBudget, report, save);
        await runEngineRows(engine, file, options, log, overBudget, report, save, llamaRows);
      }
    }
    report.finished = true;
  } catch (error) {
    report.notes.push(`run aborted: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}`);
    log(`run aborted: ${String(error)}`);
    throw error;
  } finally {
    await save();
    await engine.unload();
    await llama?.dispose();
    gpu.destroy();
    releaseNodeGpu();
  }
  return { report, jsonPath, mdPath };
}

/** Why a row past the model's context length does not run. */
function beyondContext(file: BenchModelFile): string {
  return `beyond the model's context length (${file.shape.contextLength})`;
}

async function runLlamaRows(
  llama: LlamaCppRunner | null,
  file: BenchModelFile,
  options: BenchOptions,
  log: (line: string) => void,
  overBudget: () => boolean,
  report: BenchReport,
  save: () => Promise<void>,
): Promise<BenchRow[]> {
  const rows: BenchRow[] = [];
  const base = { runtime: 'llama.cpp' as const, model: file.shape.id, weights: file.mix };
  for (const kv of options.llamaKv) {
    let estimate: { context: number; seconds: number } | null = null;
    for (const context of options.contexts) {
      const row: BenchRow = { ...base, kv, context, status: 'skipped', reason: '' };
      rows.push(row);
      report.rows.push(row);
      if (context > file.shape.contextLength) {
        row.reason = beyondContext(file);
        continue;
      }
      if (!llama) {
        row.status = 'not available';
        row.reason = report.llama.available ? 'llama.cpp not started' : report.llama.reason;
        continue;
      }
      if (overBudget()) {
        row.reason = 'run budget reached';
        continue;
      }
      const predicted = estimate ? estimate.seconds * (context / estimate.context) ** 1.5 : 0;
      if (predicted > options.prefillLimitSeconds) {
        row.reason = `estimated prefill ${predicted.toFixed(0)} s > --prefill-limit-s ${options.prefillLimitSeconds}`;
        continue;
      }
      try {
        await llama.loadModel(file.path);
        log(`llama.cpp ${file.shape.id} ${file.mix} kv=${kv} ctx=${context}`);
        const prompt = context - options.decodeSteps;
        const ids = promptIds(file.shape.vocab, prompt, options.seed + context);
        const { timing, vramUsedBytes } = await llama.measure({
          kv,
          context,
          decodeSteps: options.decodeSteps,
          repeats: options.repeats,
          warmupTokens: Math.min(prompt, options.llamaBatch),
          budgetMs: options.rowBudgetSeconds * 1000,
          promptIds: ids,
        });
        const kvBytesPerToken = llamaKvBytesPerToken(file, kv);
        const read = bytesRead(file, kvBytesPerToken, prompt + options.decodeSteps / 2);
        Object.assign(row, {
          status: 'ok',
          reason: undefined,
          promptTokens: prompt,
          decodeSteps: options.decodeSteps,
          fill: 'prefill',
          repeats: timing.repeats,
          repeatsRequested: timing.repeatsRequested,
          prefillTokensPerSecond: timing.prefillTokensPerSecond?.median ?? null,
          prefillSpread: timing.prefillTokensPerSecond,
          ttftMs: timing.ttftMs,
          tpotMs: timing.tpotMs,
          decodeTokensPerSecond: timing.decodeTokensPerSecond,
          kvBytesPerToken,
          gpuMemoryBytes: vramUsedBytes,
          decodeBytesPerToken: read,
          achievedGBps: read.total / (timing.tpotMs.median / 1000) / 1e9,
        } satisfies Partial<BenchRow>);
        delete row.reason;
        estimate = { context, seconds: (timing.ttftMs?.median ?? 0) / 1000 };
        log(
          `  prefill ${row.prefillTokensPerSecond?.toFixed(1)} tok/s, decode ${row.decodeTokensPerSecond?.toFixed(1)} tok/s`,
        );
      } catch (error) {
        row.status = 'error';
        row.reason = error instanceof Error ? error.message : String(error);
        log(`  error: ${row.reason}`);
      }
      await save();
    }
  }
  await llama?.unloadModel();
  return rows;
}

async function runEngineRows(
  engine: EngineRunner,
  file: BenchModelFile,
  options: BenchOptions,
  log: (line: string) => void,
  overBudget: () => boolean,
  report: BenchReport,
  save: () => Promise<void>,
  llamaRows: BenchRow[],
): Promise<void> {
  const base = { runtime: 'longtab' as const, model: file.shape.id, weights: file.mix };
  const fits = (context: number) => context <= file.shape.contextLength;
  // The pool is sized for the longest context the model takes.
  const longest = Math.max(0, ...options.contexts.filter(fits));
  for (const kv of options.kv) {
    const all = options.contexts.map((context): BenchRow => ({ ...base, kv, context, status: 'skipped', reason: '' }));
    report.rows.push(...all);
    for (const row of all) if (!fits(row.context)) row.reason = beyondContext(file);
    const rows = all.filter((row) => fits(row.context));
    if (rows.length === 0) continue;
    if (overBudget()) {
      for (const row of rows) row.reason = 'run budget reached';
      continue;
    }
    log(`longtab ${file.shape.id} ${file.mix} kv=${kv}: loading`);
    let loaded: Awaited<ReturnType<EngineRunner['load']>>;
    const calibrated = options.calibrate && kv === 'int2';
    try {
      // What `longtab calibrate` fits (cached by the model's digest); the load then finds it in the cache.
      if (calibrated && (await ensureCalibrated(engine.gpu, file.path))) log('  calibrated');
      loaded = await engine.load(
        file,
        kv,
        longest,
        options.prefillChunk,
        { prefillMatmul: options.prefillMatmul, prefillAttention: options.prefillAttention },
        calibrated ? nodeRotationCache() : undefined,
      );
    } catch (error) {
      for (const row of rows) {
        row.status = 'error';
        row.reason = `load failed: ${error instanceof Error ? error.message : String(error)}`;
      }
      log(rows[0].reason!);
      await save();
      continue;
    }
    if (!loaded.available) {
      for (const row of rows) {
        row.status = 'not available';
        row.reason = loaded.reason ?? `kv ${kv} is not available`;
      }
      log(`  kv=${kv} not available: ${loaded.reason}`);
      await save();
      continue;
    }
    let estimate: { context: number; seconds: number } | null = null;
    for (const row of rows) {
      const context = row.context;
      if (overBudget()) {
        row.reason = 'run budget reached';
        continue;
      }
      const predicted = estimate ? estimate.seconds * (context / estimate.context) ** 1.5 : 0;
      const fill: FillMode =
        options.fill === 'auto' ? (predicted > options.prefillLimitSeconds ? 'fast' : 'prefill') : options.fill;
      const prompt = context - options.decodeSteps;
      log(`longtab ${file.shape.id} ${file.mix} kv=${kv} ctx=${context} fill=${fill}`);
      try {
        const result = await engine.measure({
          context,
          decodeSteps: options.decodeSteps,
          repeats: options.repeats,
          fill,
          budgetMs: options.rowBudgetSeconds * 1000,
          promptIds: promptIds(file.shape.vocab, prompt, options.seed + context),
        });
        const t = result.timing;
        const read = {
          weights: result.weightBytesReadPerToken,
          kv: result.kvBytesReadPerToken,
          total: result.weightBytesReadPerToken + result.kvBytesReadPerToken,
        };
        Object.assign(row, {
          status: 'ok',
          promptTokens: prompt,
          decodeSteps: options.decodeSteps,
          fill,
          prefillChunk: engine.prefillChunk,
          repeats: t.repeats,
          repeatsRequested: t.repeatsRequested,
          prefillTokensPerSecond: t.prefillTokensPerSecond?.median ?? null,
          prefillSpread: t.prefillTokensPerSecond,
          ttftMs: t.ttftMs,
          tpotMs: t.tpotMs,
          decodeTokensPerSecond: t.decodeTokensPerSecond,
          kvBytesPerToken: result.kvBytesPerToken,
          gpuMemoryBytes: result.memory.totalBytes,
          memory: result.memory,
          kvPool: result.kvPool,
          decodeBytesPerToken: read,
          achievedGBps: read.total / (t.tpotMs.median / 1000) / 1e9,
          graph: result.graph,
          ...(result.kvPlan ? { kvPlan: result.kvPlan } : {}),
        } satisfies Partial<BenchRow>);
        delete row.reason;
        row.vsLlama = {};
        for (const l of llamaRows) {
          if (l.context !== context || l.status !== 'ok') continue;
          row.vsLlama[l.kv] = {
            decode: (row.decodeTokensPerSecond ?? Number.NaN) / (l.decodeTokensPerSecond ?? Number.NaN),
            prefill:
              row.prefillTokensPerSecond && l.prefillTokensPerSecond
                ? row.prefillTokensPerSecond / l.prefillTokensPerSecond
                : null,
            ttft: row.ttftMs && l.ttftMs ? l.ttftMs.median / row.ttftMs.median : null,
          };
        }
        if (fill === 'prefill') estimate = { context, seconds: (t.ttftMs?.median ?? 0) / 1000 };
        log(
          `  prefill ${row.prefillTokensPerSecond?.toFixed(1) ?? '–'} tok/s, decode ${row.decodeTokensPerSecond?.toFixed(1)} tok/s, ${result.graph.dispatches} dispatches/token`,
        );
      } catch (error) {
        row.status = 'error';
        row.reason = error instanceof Error ? error.message : String(error);
        log(`  error: ${row.reason}`);
      }
      await save();
    }
  }
  // Each other KV mode's decode over the f16 rows' of this model (after every mode ran: --kv may list f16 last).
  const own = report.rows.filter(
    (r) => r.runtime === 'longtab' && r.model === base.model && r.weights === base.weights,
  );
  for (const row of own) {
    const f16 = own.find((r) => r.kv === 'f16' && r.context === row.context && r.status === 'ok');
    if (row.kv !== 'f16' && row.status === 'ok' && row.decodeTokensPerSecond && f16?.decodeTokensPerSecond) {
      row.vsOwnF16 = { decode: row.decodeTokensPerSecond / f16.decodeTokensPerSecond };
    }
  }
  await save();
  await engine.unload();
}

async function main(): Promise<void> {
  const log = (line: string) => process.stderr.write(`[bench ${new Date().toISOString().slice(11, 19)}] ${line}\n`);
  process.on('unhandledRejection', (reason) => log(`unhandled rejection: ${String(reason)}`));
  const options = parseBenchArgs(process.argv.slice(2), log);
  const { report, jsonPath, mdPath } = await runBench(options);
  process.stdout.write(renderMarkdown(report));
  log(`wrote ${jsonPath} and ${mdPath}`);
}

runAsEntry(import.meta.url, main);
