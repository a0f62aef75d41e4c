import { readFileSync } from 'node:fs';
import { Engine, type LoadOptions } from '../engine/engine.ts';
import { InvalidRequestError } from '../errors.ts';
import { perplexity, topOneAgreement } from '../eval/perplexity.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import type { GpuContext } from '../gpu/device.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { defaultModelPath } from './default-model.ts';

/** The KV configurations an evaluation compares, by name. */
export function kvOptionsFor(name: string): LoadOptions {
  switch (name) {
    case 'f16':
      return { kv: 'f16' };
    case 'int2':
    case 'int2-hadamard':
      return { kv: 'int2', rotation: 'hadamard' };
    case 'int2-none':
      // The weak control: naive INT2, no rotation, no clipping.
      return { kv: 'int2', rotation: 'none' };
    case 'int2-calibrated':
      return { kv: 'int2', rotation: 'calibrated', rotationCache: nodeRotationCache() };
    case 'int1-none':
      // The weakest control: 1-bit codes, no rotation.
      return { kv: 'int2', rotation: 'none', codeBits: 1 };
    default:
      throw new InvalidRequestError(
        `Unknown KV configuration '${name}': use f16, int2 (= int2-hadamard), int2-calibrated, int2-none or int1-none.`,
      );
  }
}

/**
 * `longtab eval --model FILE --text FILE... --ctx N --kv f16 [--compare] [--json]`: perplexity over
 * non-overlapping windows of N tokens; with --compare, the top-1 agreement with the f16 cache.
 */
export async function runEval(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const texts = [stringFlag(args, 'text'), ...args.positional].filter((t): t is string => Boolean(t));
  if (texts.length === 0)
    throw new InvalidRequestError('Usage: longtab eval --model FILE --text FILE [FILE...] --ctx N --kv MODE');
  const ctx = numberFlag(args, 'ctx', 512);
  const maxWindows = numberFlag(args, 'max-windows', Number.POSITIVE_INFINITY);
  const modes = (stringFlag(args, 'kv') ?? 'f16').split(',');
  if (args.flags.has('compare') && !modes.includes('f16')) modes.unshift('f16');
  const engine = new Engine(gpu);
  const source = await sourceFromPath(modelPath);
  const rows: Array<{
    kv: string;
    windows: number;
    tokens: number;
    perplexity: number;
    top1AgreementWithF16?: number;
  }> = [];
  try {
    let reference: Int32Array[] | null = null;
    for (const mode of modes) {
      // Small prefill chunks: every query of a chunk sees the chunk itself in f16, so the chunk is kept well below
      // the window for the evaluation to measure what decoding sees.
      await engine.load(source, {
        ...kvOptionsFor(mode),
        prefillChunk: numberFlag(args, 'chunk', 64),
        ...(args.flags.has('sink') ? { sink: numberFlag(args, 'sink', 64) } : {}),
        ...(args.flags.has('window') ? { window: numberFlag(args, 'window', 256) } : {}),
        ...(args.flags.has('group-size') ? { groupSize: numberFlag(args, 'group-size', 128) } : {}),
      });
      const ids: number[] = [];
      for (const path of texts)
        for (const id of engine.tokenizer.encode(readFileSync(path, 'utf8'), { addSpecial: false })) ids.push(id);
      const result = await perplexity(engine, ids, ctx, engine.config.vocab, { maxWindows });
      if (mode === 'f16') reference = result.argmax;
      rows.push({
        kv: mode,
        windows: result.windows,
        tokens: result.tokensScored,
        perplexity: result.perplexity,
        ...(reference && mode !== 'f16' ? { top1AgreementWithF16: topOneAgreement(reference, result.argmax) } : {}),
      });
      engine.unload();
    }
  } finally {
    engine.unload();
    await source.close?.();
  }
  const f16 = rows.find((r) => r.kv === 'f16');
  const report = rows.map((r) => ({ ...r, vsF16: f16 ? r.perplexity / f16.perplexity - 1 : undefined }));
  const verdict = judgeTable(report);
  if (args.flags.has('json')) {
    process.stdout.write(
      `${JSON.stringify({ model: modelPath, ctx, texts, adapter: gpu.adapter, results: report, verdict }, null, 2)}\n`,
    );
  } else {
    process.stdout.write(
      `| KV | windows | tokens | perplexity | vs f16 | top-1 agreement |\n|---|---|---|---|---|---|\n`,
    );
    for (const r of report) {
      const vs = r.vsF16 === undefined ? '' : `${(r.vsF16 * 100).toFixed(2)}%`;
      const agree = r.top1AgreementWithF16 === undefined ? '' : `${(r.top1AgreementWithF16 * 100).toFixed(1)}%`;
      process.stdout.write(
        `| ${r.kv} | ${r.windows} | ${r.tokens} | ${r.perplexity.toFixed(3)} | ${vs} | ${agree} |\n`,
      );
    }
    process.stdout.write(`\n${verdict.status.toUpperCase()}: ${verdict.reason}\n`);
  }
  return 0;
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
