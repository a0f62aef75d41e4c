import { ContextOverflowError, InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { planStats } from '../engine/kv-stats.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { defaultModelPath } from './default-model.ts';
import { cliLoadOptions, evalModes, kvOptionsFor, prepareModes } from './eval.ts';

/** Positions per fill step (and prefill chunk) during a capacity run. */
const CAPACITY_STEP_TOKENS = 32;

/** The KV configurations `capacity` compares unless --kv lists others (names as `longtab eval --kv`). */
const DEFAULT_CAPACITY_MODES = 'f16,int2';

export interface CapacityRow {
  kv: string;
  /** Longest sequence the budget holds, found by allocating it. */
  contextTokens: number;
  kvBytesUsed: number;
  /** KV bytes per element actually used at that length (all page kinds, all layers, K and V). */
  effectiveBitsPerElement: number;
  /** Decode steps run at that length, and their mean time (the attention really read every page). */
  decodeSteps: number;
  decodeMsPerToken: number;
  /** int2: the precision plan the pages were laid out by (null for f16). */
  plan: { summary: string; source: string; bitsPerElementAt32K: number } | null;
}

/** Fills one sequence to the largest length the budget allows, then runs decode steps at that length. */
export async function measureCapacity(
  engine: ModelRunner,
  options: { decodeSteps: number },
): Promise<Omit<CapacityRow, 'kv'>> {
  const m = engine.loaded!;
  const { pool, config } = m;
  const seq = pool.createSequence();
  try {
    let available = 0;
    try {
      pool.reserve(seq, Number.MAX_SAFE_INTEGER >>> 8);
    } catch (error) {
      if (!(error instanceof ContextOverflowError)) throw error;
      available = error.tokensAvailable;
    }
    const steps = options.decodeSteps;
    if (available <= steps + 1) throw new InvalidRequestError(`The KV budget holds only ${available} tokens.`);
    // Fill the pages directly (their content does not matter for capacity): positions advance in prefill-sized
    // steps without running the model, so even a CPU driver reaches hundreds of thousands of tokens.
    const chunk = m.transformer.maxTokens;
    const filled = available - steps - 1; // generation reserves prompt + max_tokens positions
    for (let position = 0; position < filled - 1; position += chunk) {
      pool.writeStep(seq, position, Math.min(chunk, filled - 1 - position));
    }
    const started = performance.now();
    const result = await engine.generateInSequence(seq, {
      promptIds: new Array(filled).fill(0),
      reuseTokens: filled - 1,
      maxTokens: steps,
      stopAtEog: false,
    });
    const elapsed = performance.now() - started;
    const stats = pool.stats();
    const kvBytesUsed = stats.bytesUsed;
    const elements = seq.length * config.layers * 2 * config.kvHeads * config.headDim;
    const plan = planStats(pool, m.kv.options);
    return {
      plan: plan ? { summary: plan.summary, source: plan.source, bitsPerElementAt32K: plan.bitsPerElementAt32K } : null,
      contextTokens: seq.length,
      kvBytesUsed,
      effectiveBitsPerElement: (kvBytesUsed * 8) / elements,
      decodeSteps: result.ids.length,
      decodeMsPerToken: elapsed / Math.max(result.ids.length, 1),
    };
  } finally {
    pool.free(seq);
  }
}

/**
 * `longtab capacity [--model FILE] --kv-budget BYTES [--kv f16,int2,...] [--decode-steps N] [--json]`: per KV
 * mode, the largest context that fits the budget and its effective bits per element, found by allocating it and
 * decoding at it. f16 is always measured (the ratio's denominator).
 */
export async function runCapacity(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const budget = numberFlag(args, 'kv-budget', 0);
  if (!Number.isInteger(budget) || budget <= 0)
    throw new InvalidRequestError('--kv-budget BYTES is required (a positive integer).');
  const decodeSteps = numberFlag(args, 'decode-steps', 4);
  const names = evalModes(args, DEFAULT_CAPACITY_MODES, true);
  const modes = names.map((name) => ({ name, options: kvOptionsFor(name) }));
  await prepareModes(gpu, names, modelPath);
  const rows: CapacityRow[] = [];
  const source = await sourceFromPath(modelPath);
  const engine = new ModelRunner(gpu);
  try {
    for (const mode of modes) {
      // One sequence and short steps: the f16 share of an int2 pool is sized for what one sequence's sink, window and
      // step need, so the rest of the budget holds 2-bit pages (a decode-only workload; prompts prefill the same way).
      await engine.load(
        source,
        cliLoadOptions({
          ...mode.options,
          kvBudgetBytes: budget,
          maxSequences: 1,
          maxContextTokens: 1 << 24,
          prefillChunk: CAPACITY_STEP_TOKENS,
        }),
      );
      rows.push({ kv: mode.name, ...(await measureCapacity(engine, { decodeSteps })) });
      engine.unload();
    }
  } finally {
    engine.unload();
    await source.close?.();
  }
  const f16 = rows.find((r) => r.kv === 'f16')!;
  const report = {
    model: modelPath,
    kvBudgetBytes: budget,
    adapter: gpu.adapter,
    rows: rows.map((r) => ({ ...r, vsF16: r.contextTokens / f16.contextTokens })),
  };
  if (args.flags.has('json')) {
    process.stdout.write(`${JSON.stringify(report, null, 2)}\n`);
  } else {
    process.stdout.write(
      '| KV | context tokens | × f16 | KV bytes used | bits / element | decode ms/token at that length | plan |\n|---|---|---|---|---|---|---|\n',
    );
    for (const r of report.rows) {
      process.stdout.write(
        `| ${r.kv} | ${r.contextTokens} | ${r.vsF16.toFixed(2)} | ${r.kvBytesUsed} | ${r.effectiveBitsPerElement.toFixed(3)} | ${r.decodeMsPerToken.toFixed(1)} | ${r.plan ? `${r.plan.source}: ${r.plan.summary}` : '—'} |\n`,
      );
    }
  }
  return 0;
}
