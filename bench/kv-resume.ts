/**
 * Resuming a long conversation: the time to the first token of a follow-up turn when the conversation's KV is resident
 * on the GPU, copied back from host memory, read back from the KV store (a directory: the Node side of OPFS), or not
 * kept at all (its history prefilled again), with the engine's own conversation cache (runtime/engine/conversations.ts)
 * on bench models (bench/models.ts). Each path starts from the same state, the history as one fill left it (restored
 * from one copy before each pass); the follow-up's greedy continuation is compared with the resident one's, and the
 * pages a resume brings back with that copy, byte for byte.
 *
 *   npx tsx bench/kv-resume.ts [--models llama-3.2-1b,qwen3-4b] [--weights q4_0] [--kv int2] [--context 32768]
 *                              [--follow-up 64] [--continuation 16] [--repeats 3] [--out FILE.json]
 *   on the GPU host: node .gpu/kv-resume.mjs … (npm run bench:bundle)
 *
 * TTFT is wall time from the start of the turn (its KV brought back, where it is) to the first token read back. The
 * store's files are read right after they were written, so from the OS page cache: a cold disk adds its read time.
 */
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';
import { type CachedSequence, ConversationCache } from '../runtime/engine/conversations.ts';
import { nodeKvFileStore } from '../runtime/engine/kv-file-store-node.ts';
import type { KvMode, ModelRunner } from '../runtime/engine/model-runner.ts';
import type { KvSequenceImage } from '../runtime/kv/pool.ts';
import { GREEDY_SAMPLING } from '../runtime/sampling/params.ts';
import { type BenchLoads, forEachBenchLoad } from './engine-runner.ts';
import { runAsEntry } from './machine.ts';
import { promptIds, WEIGHT_MIXES, type WeightMix } from './models.ts';
import { spread } from './stats.ts';

export type ResumePath = 'resident' | 'host' | 'store' | 'prefill';
export const RESUME_PATHS: readonly ResumePath[] = ['resident', 'host', 'store', 'prefill'];
/** Where each path's turn must have found its KV (CachedSequence.resumed.from). */
const FROM = { resident: 'gpu', host: 'host', store: 'storage', prefill: 'none' } as const;

export interface ResumeRow {
  model: string;
  weights: WeightMix;
  kv: KvMode;
  /** Tokens of history before the follow-up turn. */
  context: number;
  followUp: number;
  path: ResumePath;
  ttftMs: { median: number; p10: number; p90: number; all: number[] };
  /** Median TTFT ÷ the prefill path's. */
  vsPrefill: number | null;
  /** Copying the history out (host) or writing it to the store, ms (median; the eviction, not in the TTFT). */
  saveMs: number | null;
  /** Bytes of the history's pages as they were copied or stored. */
  bytes: number;
  /** The follow-up's greedy continuation equals the resident one's. */
  sameContinuation: boolean;
  /** host and store: the pages brought back equal the copy they came from, byte for byte (null: not a copy). */
  bitExact: boolean | null;
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** One model and KV mode: every path, `repeats` times, from the same history. */
async function measureResume(
  runner: ModelRunner,
  options: { model: string; weights: WeightMix; kv: KvMode; context: number; followUp: number; continuation: number },
  repeats: number,
  storeDir: string,
  log: (line: string) => void,
): Promise<ResumeRow[]> {
  const pool = runner.pool;
  const vocab = runner.config.vocab;
  const history = promptIds(vocab, options.context, 1);
  const followUp = promptIds(vocab, options.followUp + 1, 2).slice(1);
  const host = new ConversationCache(runner, { hostBudgetBytes: Number.MAX_SAFE_INTEGER });
  const store = new ConversationCache(runner, { hostBudgetBytes: 0, store: nodeKvFileStore(storeDir) });

  // The history, filled once; every pass starts from a copy of it.
  const fill = host.conversation('fill');
  await host.attach(fill, null);
  await host.makeRoom([fill], fill.seq, 0, history.length + 1);
  const first = await runner.generateInSequence(fill.seq!, {
    promptIds: history,
    maxTokens: 1,
    sampling: GREEDY_SAMPLING,
    stopAtEog: false,
  });
  const held = [...history, ...first.ids].slice(0, fill.seq!.length);
  const origin: KvSequenceImage = await pool.saveSequence(fill.seq!);
  host.evict(fill);
  const prompt = [...held, ...followUp];
  log(`${options.model} ${options.kv}: history of ${held.length} tokens, ${origin.bytes.byteLength} bytes of pages`);

  /** A conversation of `cache` holding the history, on the GPU. */
  const resident = (cache: ConversationCache, id: string): CachedSequence => {
    const entry = cache.conversation(id);
    entry.seq = pool.restoreSequence(origin);
    entry.ids = held.slice();
    return entry;
  };
  /** The follow-up turn as the engine runs it: KV brought back where it is, then the prompt past what it holds. */
  const turn = async (cache: ConversationCache, entry: CachedSequence) => {
    const started = performance.now();
    let firstAt = 0;
    await cache.attach(entry, null);
    const reuse = Math.min(entry.ids.length, prompt.length - 1);
    await cache.makeRoom([entry], entry.seq, reuse, prompt.length + options.continuation);
    const result = await runner.generateInSequence(entry.seq!, {
      promptIds: prompt,
      reuseTokens: reuse,
      maxTokens: options.continuation,
      sampling: GREEDY_SAMPLING,
      stopAtEog: false,
      onToken: () => {
        if (firstAt === 0) firstAt = performance.now();
        return undefined;
      },
    });
    cache.evict(entry);
    return { ttftMs: firstAt - started, ids: result.ids };
  };

  const ttft = new Map<ResumePath, number[]>(RESUME_PATHS.map((p) => [p, []]));
  const saves = new Map<ResumePath, number[]>(RESUME_PATHS.map((p) => [p, []]));
  const continuations = new Map<ResumePath, number[][]>(RESUME_PATHS.map((p) => [p, []]));
  const exact = new Map<ResumePath, boolean>();
  for (let r = 0; r < repeats; r++) {
    for (const path of RESUME_PATHS) {
      let entry: CachedSequence;
      let cache: ConversationCache;
      if (path === 'prefill') {
        cache = host;
        entry = host.conversation(`prefill-${r}`);
      } else {
        cache = path === 'store' ? store : host;
        entry = resident(cache, `${path}-${r}`);
        if (path !== 'resident') {
          const started = performance.now();
          await cache.displace(entry);
          saves.get(path)?.push(performance.now() - started);
          if (r === 0) {
            // The pages brought back, before any turn changes them, against the copy they came from.
            await cache.attach(entry, null);
            exact.set(
              path,
              entry.resumed.from === FROM[path] && sameBytes((await pool.saveSequence(entry.seq!)).bytes, origin.bytes),
            );
            await cache.displace(entry);
          }
        }
      }
      const result = await turn(cache, entry);
      if (entry.resumed.from !== FROM[path]) {
        throw new Error(`${path} pass resumed from ${entry.resumed.from}`);
      }
      ttft.get(path)?.push(result.ttftMs);
      continuations.get(path)?.push(result.ids);
      log(`${options.model} ${options.kv} ${path} #${r}: TTFT ${result.ttftMs.toFixed(1)} ms`);
    }
  }
  await store.releaseStore();
  const reference = continuations.get('resident')?.[0] ?? [];
  const prefillMedian = spread(ttft.get('prefill') ?? []).median;
  return RESUME_PATHS.map((path) => {
    const all = ttft.get(path) ?? [];
    const s = spread(all);
    const saved = saves.get(path) ?? [];
    return {
      ...options,
      path,
      ttftMs: { median: s.median, p10: s.p10, p90: s.p90, all },
      vsPrefill: s.median / prefillMedian,
      saveMs: saved.length > 0 ? spread(saved).median : null,
      bytes: origin.bytes.byteLength,
      sameContinuation: (continuations.get(path) ?? []).every((ids) => ids.join() === reference.join()),
      bitExact: exact.get(path) ?? null,
    };
  });
}

export async function runResumeBench(
  options: BenchLoads & { context: number; followUp: number; continuation: number; repeats: number },
) {
  const rows: ResumeRow[] = [];
  const storeDir = await mkdtemp(join(tmpdir(), 'longtab-kv-resume-'));
  try {
    const span = options.context + options.followUp + options.continuation + 64;
    const measured = await forEachBenchLoad(options, span, async ({ model, weights, kv, engine }) => {
      const turn = { model, weights, kv, context: options.context, followUp: options.followUp };
      const timed = await measureResume(
        engine.engine,
        { ...turn, continuation: options.continuation },
        options.repeats,
        storeDir,
        options.log,
      );
      for (const row of timed) options.log(JSON.stringify({ ...row, ttftMs: { ...row.ttftMs, all: undefined } }));
      rows.push(...timed);
    });
    return { ...measured, rows };
  } finally {
    await rm(storeDir, { recursive: true, force: true });
  }
}

export function renderResumeMarkdown(rows: readonly ResumeRow[]): string {
  const lines = [
    '# Resuming a conversation: TTFT of a follow-up turn by where its KV is (bench/kv-resume.ts)',
    '',
    '| model | weights | KV | history | follow-up | KV from | TTFT ms (p10–p90) | ÷ prefill | copy-out ms | MB | same continuation | pages bit-exact |',
    '| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |',
  ];
  for (const r of rows) {
    const t = r.ttftMs;
    lines.push(
      `| ${r.model} | ${r.weights} | ${r.kv} | ${r.context} | ${r.followUp} | ${r.path} | ${t.median.toFixed(1)} (${t.p10.toFixed(1)}–${t.p90.toFixed(1)}) | ${r.vsPrefill === null ? '—' : r.vsPrefill.toFixed(3)} | ${r.saveMs === null ? '—' : r.saveMs.toFixed(1)} | ${(r.bytes / 1e6).toFixed(1)} | ${r.sameContinuation ? 'yes' : 'no'} | ${r.bitExact === null ? '—' : r.bitExact ? 'yes' : 'no'} |`,
    );
  }
  return `${lines.join('\n')}\n`;
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      models: { type: 'string', default: 'llama-3.2-1b,qwen3-4b' },
      weights: { type: 'string', default: 'q4_0' },
      kv: { type: 'string', default: 'int2' },
      context: { type: 'string', default: '32768' },
      'follow-up': { type: 'string', default: '64' },
      continuation: { type: 'string', default: '16' },
      repeats: { type: 'string', default: '3' },
      'models-dir': { type: 'string', default: join(tmpdir(), 'longtab-bench') },
      out: { type: 'string' },
    },
  });
  const log = (line: string) => process.stderr.write(`[resume ${new Date().toISOString().slice(11, 19)}] ${line}\n`);
  const weights = values.weights.split(',') as WeightMix[];
  for (const w of weights) if (!WEIGHT_MIXES.includes(w)) throw new Error(`--weights: unknown mix ${w}`);
  const kv = values.kv.split(',') as KvMode[];
  for (const k of kv) if (k !== 'f16' && k !== 'int2') throw new Error(`--kv: unknown mode ${k}`);
  const result = await runResumeBench({
    models: values.models.split(','),
    weights,
    kv,
    context: Number(values.context),
    followUp: Number(values['follow-up']),
    continuation: Number(values.continuation),
    repeats: Number(values.repeats),
    modelsDir: values['models-dir'],
    log,
  });
  const out =
    values.out ?? join('bench', 'results', `${new Date().toISOString().slice(0, 10)}-${result.slug}-kv-resume.json`);
  await mkdir(dirname(out), { recursive: true });
  await writeFile(out, `${JSON.stringify({ ...result, date: new Date().toISOString() }, null, 2)}\n`);
  await writeFile(out.replace(/\.json$/, '.md'), renderResumeMarkdown(result.rows));
  process.stdout.write(renderResumeMarkdown(result.rows));
}

runAsEntry(import.meta.url, main);
