import { InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import type { EngineLoadOptions, PrefillAttention } from '../engine/api-types.ts';
import { parseLoadOptions } from '../engine/load-options.ts';
import { type LoadOptions, ModelRunner } from '../engine/model-runner.ts';
import { pairedPerplexityRatioInterval, perplexity, topOneAgreement } from '../eval/perplexity.ts';
import {
  analyticChance,
  DEFAULT_RETRIEVAL_SEED,
  formatRetrievalTable,
  judgeRetrieval,
  RETRIEVAL_TASKS,
  type RetrievalRow,
  type RetrievalSettings,
  type RetrievalTask,
  RetrievalTaskBuilder,
  runCell,
} from '../eval/retrieval.ts';
import { readTextFromPath, sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import { readModelConfig } from '../model/config.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { ensureCalibrated } from './calibrate.ts';
import { defaultModelPath } from './default-model.ts';

/** The KV configurations an evaluation compares, by name (as `load` takes them; cliLoadOptions checks them). */
export function kvOptionsFor(name: string): EngineLoadOptions {
  // MODE+L5 or MODE+L5.6: an int2 mode with those layers boosted to 4 bits (the `boostLayers` load option).
  const boosted = /^([^+]+)\+L(\d+(?:\.\d+)*)$/.exec(name);
  if (boosted) {
    const base = kvOptionsFor(boosted[1]);
    if (base.kv !== 'int2') throw new InvalidRequestError(`'${name}': only an int2 mode can boost layers.`);
    return { ...base, experimental: { ...base.experimental, boostLayers: boosted[2].split('.').map(Number) } };
  }
  switch (name) {
    case 'f16':
      return { kv: 'f16' };
    case 'int2':
      // What a user gets with kv: 'int2' once calibrated: the calibrated rotations and the calibration's precision plan.
      return { kv: 'int2', rotation: 'calibrated' };
    case 'int2-calibrated':
      // Calibrated rotations with one 2-bit format and the fitted clip in every layer (the cache before plans).
      return { kv: 'int2', rotation: 'calibrated', experimental: { precisionPlan: 'uniform' } };
    case 'int2-hadamard':
      return { kv: 'int2', rotation: 'hadamard' };
    case 'int2-none':
      // The weak control: naive INT2, no rotation, no clipping.
      return { kv: 'int2', rotation: 'none' };
    case 'int1-none':
      // The weakest control: 1-bit codes, no rotation.
      return { kv: 'int2', rotation: 'none', experimental: { codeBits: 1 } };
    default:
      throw new InvalidRequestError(
        `Unknown KV configuration '${name}': use f16, int2 (what kv: 'int2' runs once calibrated), int2-calibrated (calibrated rotations, one format in every layer), int2-hadamard, int2-none or int1-none; an int2 mode may end in +L5 (layer 5 at 4 bits) or +L5.6.`,
      );
  }
}

/**
 * What a command hands ModelRunner.load: `options` checked by parseLoadOptions (flags are user input like any other),
 * with the rotation cache where calibrated rotations are asked for.
 */
export function cliLoadOptions(options: EngineLoadOptions): LoadOptions {
  const parsed = parseLoadOptions(options);
  // An omitted rotation is 'calibrated' in int2 where rotations are stored: the cache is one of the places.
  return parsed.rotation === 'calibrated' || parsed.rotation === undefined
    ? { ...parsed, rotationCache: nodeRotationCache() }
    : parsed;
}

/**
 * The KV modes of a command: --kv's list (else `fallback`), with f16 first when `withF16` (eval: under --compare);
 * checked before anything loads.
 */
export function evalModes(args: ParsedArgs, fallback = 'f16', withF16 = args.flags.has('compare')): string[] {
  const modes = (stringFlag(args, 'kv') ?? fallback).split(',');
  if (withF16 && !modes.includes('f16')) modes.unshift('f16');
  for (const mode of modes) kvOptionsFor(mode);
  return modes;
}

/**
 * Before a command runs `modes` on `modelPath`: the boosted layers exist (checkModesFitModel), and a model without
 * calibrated rotations is calibrated first (with progress) when a mode needs them.
 */
export async function prepareModes(gpu: GpuContext, modes: readonly string[], modelPath: string): Promise<void> {
  await checkModesFitModel(modes, modelPath);
  if (modes.some((mode) => kvOptionsFor(mode).rotation === 'calibrated')) await ensureCalibrated(gpu, modelPath);
}

/**
 * Checks, from the GGUF header alone, that every boosted layer a mode names exists in the model, so a typo in the
 * last mode of a long evaluation fails before the first one runs.
 */
export async function checkModesFitModel(modes: readonly string[], modelPath: string): Promise<void> {
  const wanted = modes.map((mode) => ({ mode, layers: kvOptionsFor(mode).experimental?.boostLayers ?? [] }));
  if (wanted.every((w) => w.layers.length === 0)) return;
  const source = await sourceFromPath(modelPath);
  try {
    const { layers } = readModelConfig(await parseGguf(source));
    for (const { mode, layers: boosted } of wanted) {
      const missing = boosted.find((l) => l >= layers);
      if (missing !== undefined)
        throw new InvalidRequestError(`'${mode}': the model has layers 0..${layers - 1}, not ${missing}.`);
    }
  } finally {
    await source.close?.();
  }
}

/** Load options of one mode. Small prefill chunks: see runEval. */
export function evalLoadOptions(args: ParsedArgs, mode: string): LoadOptions {
  const base = kvOptionsFor(mode);
  const flag = <T>(name: string, value: () => T) => (args.flags.has(name) ? value() : undefined);
  return cliLoadOptions({
    ...base,
    prefillChunk: numberFlag(args, 'chunk', 64),
    kvBudgetBytes: flag('kv-budget', () => numberFlag(args, 'kv-budget', 0)),
    experimental: {
      ...base.experimental,
      sink: flag('sink', () => numberFlag(args, 'sink', 64)),
      window: flag('window', () => numberFlag(args, 'window', 256)),
      groupSize: flag('group-size', () => numberFlag(args, 'group-size', 128)),
      prefillMatmul: flag('prefill-matmul', () => stringFlag(args, 'prefill-matmul') as PrefillAttention),
      prefillAttention: flag('prefill-attention', () => stringFlag(args, 'prefill-attention') as PrefillAttention),
    },
  });
}

/**
 * `longtab eval --model FILE --text FILE... --ctx N --kv f16 [--compare] [--json]`: perplexity over
 * non-overlapping windows of N tokens; with --compare, the top-1 agreement with the f16 cache.
 */
export async function runEval(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  if (args.flags.has('task')) return runRetrievalEval(args, gpu);
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const texts = [stringFlag(args, 'text'), ...args.positional].filter((t): t is string => Boolean(t));
  if (texts.length === 0)
    throw new InvalidRequestError('Usage: longtab eval --model FILE --text FILE [FILE...] --ctx N --kv MODE');
  // The texts are read before anything loads: a wrong path fails at once, not after the model.
  const textContents = texts.map((path) => readTextFromPath(path, 'the text file'));
  const ctx = numberFlag(args, 'ctx', 512);
  const maxWindows = numberFlag(args, 'max-windows', Number.POSITIVE_INFINITY);
  const modes = evalModes(args);
  await prepareModes(gpu, modes, modelPath);
  const log = progressLog(args);
  const engine = new ModelRunner(gpu);
  const source = await sourceFromPath(modelPath);
  const rows: Array<{
    kv: string;
    windows: number;
    tokens: number;
    perplexity: number;
    windowMeanNll: number[];
  }> = [];
  // Each mode's top-1 choices, compared with f16's after the loop (whatever order --kv lists the modes in).
  const argmax = new Map<string, Int32Array[]>();
  try {
    for (const mode of modes) {
      // Small prefill chunks: every query of a chunk sees the chunk itself in f16, so the chunk is kept well below
      // the window for the evaluation to measure what decoding sees.
      await engine.load(source, evalLoadOptions(args, mode));
      const ids: number[] = [];
      for (const text of textContents)
        for (const id of engine.tokenizer.encode(text, { addSpecial: false })) ids.push(id);
      const started = performance.now();
      const result = await perplexity(engine, ids, ctx, engine.config.vocab, { maxWindows });
      // One line per mode as it finishes: a run cut short (a GPU host's time limit) still leaves its finished rows.
      log(
        `[${mode}] ${result.windows} windows of ${ctx}: perplexity ${result.perplexity.toFixed(3)}, ${((performance.now() - started) / 1000).toFixed(1)} s`,
      );
      argmax.set(mode, result.argmax);
      rows.push({
        kv: mode,
        windows: result.windows,
        tokens: result.tokensScored,
        perplexity: result.perplexity,
        windowMeanNll: result.windowMeanNll,
      });
      engine.unload();
    }
  } finally {
    engine.unload();
    await source.close?.();
  }
  const f16 = rows.find((r) => r.kv === 'f16');
  const reference = argmax.get('f16');
  const report = rows.map((r) => {
    // 95% interval of perplexity / f16's − 1, paired over windows (runtime/eval/perplexity.ts).
    const interval = f16 && r !== f16 ? pairedPerplexityRatioInterval(r.windowMeanNll, f16.windowMeanNll) : null;
    const choices = argmax.get(r.kv);
    return {
      ...r,
      ...(reference && choices && r !== f16 ? { top1AgreementWithF16: topOneAgreement(reference, choices) } : {}),
      vsF16: f16 ? r.perplexity / f16.perplexity - 1 : undefined,
      ...(interval ? { vsF16Interval95: interval } : {}),
    };
  });
  const verdict = judgeTable(report);
  if (args.flags.has('json')) {
    process.stdout.write(
      `${JSON.stringify({ model: modelPath, ctx, texts, adapter: gpu.adapter, results: report, verdict }, null, 2)}\n`,
    );
  } else {
    process.stdout.write(
      `| KV | windows | tokens | perplexity | vs f16 | 95% CI (paired windows) | top-1 agreement |\n|---|---|---|---|---|---|---|\n`,
    );
    const percent = (x: number) => `${(x * 100).toFixed(2)}%`;
    for (const r of report) {
      const vs = r.vsF16 === undefined ? '' : percent(r.vsF16);
      const ci = r.vsF16Interval95 ? `[${percent(r.vsF16Interval95.low)}, ${percent(r.vsF16Interval95.high)}]` : '';
      const agree = r.top1AgreementWithF16 === undefined ? '' : `${(r.top1AgreementWithF16 * 100).toFixed(1)}%`;
      process.stdout.write(
        `| ${r.kv} | ${r.windows} | ${r.tokens} | ${r.perplexity.toFixed(3)} | ${vs} | ${ci} | ${agree} |\n`,
      );
    }
    process.stdout.write(`\n${verdict.status.toUpperCase()}: ${verdict.reason}\n`);
  }
  return 0;
}

/** Progress on stderr (stdout stays the table or the JSON), unless --quiet. */
function progressLog(args: ParsedArgs): (line: string) => void {
  return (line) => {
    if (!args.flags.has('quiet')) process.stderr.write(`${line}\n`);
  };
}

/** The weak controls: a table in which they stay close to f16 cannot tell a good cache from a bad one. */
export const WEAK_CONTROLS = ['int2-none', 'int1-none'];
const BLIND_THRESHOLD = 0.1;

/**
 * A quality table only counts when a deliberately bad cache fails it: if every weak control it contains is within
 * 10% of f16 perplexity, the table is blind (the model does not read its history closely enough to judge).
 */
export function judgeTable(rows: Array<{ kv: string; vsF16?: number }>): {
  status: 'blind' | 'informative' | 'no-control';
  reason: string;
} {
  const controls = rows.filter((r) => WEAK_CONTROLS.includes(r.kv) && r.vsF16 !== undefined);
  if (controls.length === 0) {
    return {
      status: 'no-control',
      reason: `add a weak control (${WEAK_CONTROLS.join(' or ')}) and f16 to judge this table`,
    };
  }
  const worst = Math.max(...controls.map((r) => r.vsF16!));
  if (worst < BLIND_THRESHOLD) {
    return {
      status: 'blind',
      reason: `the weak controls are within ${(worst * 100).toFixed(1)}% of f16 perplexity (< ${BLIND_THRESHOLD * 100}%): this model and text cannot judge a KV cache, whatever the other rows say`,
    };
  }
  return {
    status: 'informative',
    reason: `the weak controls cost up to ${(worst * 100).toFixed(1)}% perplexity, so the table can separate good caches from bad`,
  };
}

function numberListFlag(args: ParsedArgs, name: string, fallback: number[]): number[] {
  const v = stringFlag(args, name);
  if (v === undefined) return fallback;
  const list = v.split(',').map((word) => Number(word));
  if (list.length === 0 || list.some((n) => !Number.isFinite(n)))
    throw new InvalidRequestError(`--${name} must be a comma-separated list of numbers, got '${v}'.`);
  return list;
}

function integerFlag(args: ParsedArgs, name: string, fallback: number, min: number): number {
  const n = numberFlag(args, name, fallback);
  if (!Number.isInteger(n) || n < min) throw new InvalidRequestError(`--${name} must be an integer >= ${min}.`);
  return n;
}

/**
 * `longtab eval --task passkey|copy|recall --text FILE... [--lengths L,...] [--depths D,...|--distances N,...]
 * [--trials 200] [--kv MODES] [--compare] [--json]`: accuracy with a Wilson 95% interval per KV mode × length ×
 * depth (copy: distance), one teacher-forced prefill per trial, the same trials for every mode.
 */
export async function runRetrievalEval(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const task = stringFlag(args, 'task') as RetrievalTask;
  if (!RETRIEVAL_TASKS.includes(task))
    throw new InvalidRequestError(`--task must be one of ${RETRIEVAL_TASKS.join(', ')}, got '${task}'.`);
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const texts = [stringFlag(args, 'text'), ...args.positional].filter((t): t is string => Boolean(t));
  if (texts.length === 0)
    throw new InvalidRequestError(`Usage: longtab eval --task ${task} --text FILLER.txt [FILE...]: the filler text.`);
  const textContents = texts.map((path) => readTextFromPath(path, 'the text file'));
  const modes = evalModes(args);
  await prepareModes(gpu, modes, modelPath);
  const lengths = numberListFlag(args, 'lengths', [1024, 2048]);
  if (task === 'copy' && args.flags.has('depths'))
    throw new InvalidRequestError('copy places its passage by --distances (tokens between the copies), not --depths.');
  if (task !== 'copy' && args.flags.has('distances'))
    throw new InvalidRequestError(`${task} places its needle by --depths (fractions 0..1), not --distances.`);
  const depths =
    task === 'copy'
      ? numberListFlag(args, 'distances', [512, 1024, 1536])
      : numberListFlag(args, 'depths', [0, 0.25, 0.5, 0.75, 1]);
  const trials = integerFlag(args, 'trials', 200, 1);
  const seed = integerFlag(args, 'seed', DEFAULT_RETRIEVAL_SEED, 0);
  const settings: Partial<RetrievalSettings> = {};
  for (const [flag, key] of [
    ['digits', 'digits'],
    ['pairs', 'pairs'],
    ['queries', 'queries'],
    ['value-digits', 'valueDigits'],
    ['copy-tokens', 'copyTokens'],
  ] as const) {
    if (args.flags.has(flag)) settings[key] = integerFlag(args, flag, 0, 0);
  }
  const log = progressLog(args);

  const engine = new ModelRunner(gpu);
  const source = await sourceFromPath(modelPath);
  const rows: RetrievalRow[] = [];
  const skipped: Array<{ length: number; depth: number; reason: string }> = [];
  let builder: RetrievalTaskBuilder | null = null;
  let cells: Array<{ length: number; depth: number }> = [];
  try {
    for (const mode of modes) {
      await engine.load(source, evalLoadOptions(args, mode));
      if (!builder) {
        const context = engine.config.contextLength;
        const tooLong = lengths.filter((l) => l > context);
        if (tooLong.length > 0) {
          throw new InvalidRequestError(
            `--lengths ${tooLong.join(',')}: the model's context is ${context} tokens; pass shorter --lengths.`,
          );
        }
        const filler: number[] = [];
        for (const text of textContents)
          for (const id of engine.tokenizer.encode(text, { addSpecial: false })) filler.push(id);
        builder = new RetrievalTaskBuilder(engine.tokenizer, filler, settings, seed);
        // A cell that cannot be built (the context too short for what it holds) is skipped and reported.
        for (const length of lengths) {
          for (const depth of depths) {
            try {
              builder.trial(task, length, depth, 0);
              cells.push({ length, depth });
            } catch (error) {
              if (!(error instanceof InvalidRequestError)) throw error;
              skipped.push({ length, depth, reason: error.message });
              log(`skipped length ${length} ${task === 'copy' ? 'distance' : 'depth'} ${depth}: ${error.message}`);
            }
          }
        }
        if (cells.length === 0)
          throw new InvalidRequestError('No cell of the grid can be built: see the reasons above.');
        log(
          `${task}: ${cells.length} cells × ${trials} trials × ${modes.length} KV modes, one prefill each (filler ${filler.length} tokens)`,
        );
      }
      for (const cell of cells) {
        const started = performance.now();
        const { summary } = await runCell(engine, builder, engine.config.vocab, { task, ...cell, trials });
        const seconds = (performance.now() - started) / 1000;
        rows.push({ kv: mode, ...cell, ...summary, seconds });
        log(
          `[${mode}] length ${cell.length} ${task === 'copy' ? 'distance' : 'depth'} ${cell.depth}: ${summary.accuracy.toFixed(3)} [${summary.ci.low.toFixed(3)}, ${summary.ci.high.toFixed(3)}] over ${trials} trials, ${seconds.toFixed(1)} s`,
        );
      }
      engine.unload();
    }
  } finally {
    engine.unload();
    await source.close?.();
  }
  cells = cells.filter((c) => rows.some((r) => r.length === c.length && r.depth === c.depth));
  const resolved = builder!.settings;
  const { chance, note } = analyticChance(task, resolved);
  const verdict = judgeRetrieval(rows, chance);
  const taskSettings =
    task === 'passkey'
      ? { digits: resolved.digits }
      : task === 'recall'
        ? { pairs: resolved.pairs, queries: resolved.queries, valueDigits: resolved.valueDigits }
        : { copyTokens: resolved.copyTokens };
  if (args.flags.has('json')) {
    const report = {
      task,
      model: modelPath,
      texts,
      adapter: gpu.adapter,
      seed,
      trials,
      settings: taskSettings,
      depthUnit: task === 'copy' ? 'tokens between the copies' : 'fraction of the filler before the needle',
      lengths,
      depths,
      modes,
      chance,
      chanceNote: note,
      results: rows,
      skipped,
      verdict,
    };
    process.stdout.write(`${JSON.stringify(report, null, 2)}\n`);
  } else {
    const what =
      task === 'passkey'
        ? `pass key of ${resolved.digits} digits, all top-1`
        : task === 'recall'
          ? `${resolved.queries} of ${resolved.pairs} key→value pairs asked, ${resolved.valueDigits}-digit values, all digits top-1; score = fraction of queries`
          : `${resolved.copyTokens}-token passage repeated; score = top-1 agreement over the repeat`;
    process.stdout.write(
      `${task} (${what}): accuracy [Wilson 95% CI], ${trials} trials per cell; chance: ${chance === null ? note : `${chance.toPrecision(2)} (${note})`}\n\n`,
    );
    process.stdout.write(formatRetrievalTable(task, rows, modes, chance));
    for (const s of skipped) process.stdout.write(`\nskipped length ${s.length}, ${s.depth}: ${s.reason}`);
    process.stdout.write(`\n${verdict.status.toUpperCase()}: ${verdict.reason}\n`);
  }
  return 0;
}
