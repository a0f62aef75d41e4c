/**
 * Constrained decode against plain decode: the TPOT of greedy decode under a response format (the grammar engine's
 * mask computed on the host and uploaded each step; runtime/grammar/constraint.ts) over the TPOT of the same load,
 * context and prompt without one. Rows alternate text and the formats repeat by repeat, so drift on the host hits both.
 * Bench models as `npm run bench` (bench/models.ts: real shapes and real vocabulary sizes).
 *
 *   npx tsx bench/constrained-decode.ts [--models llama-3.2-1b,qwen3-4b] [--weights q4_0] [--kv f16,int2]
 *                                       [--context 1024] [--decode-steps 64] [--repeats 5] [--out FILE.json]
 *   on the GPU host: node .gpu/constrained-decode.mjs … (npm run bench:bundle)
 *
 * A format may end before its steps (its stop token drawn): the row says how many steps it timed.
 */
import { mkdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';
import type { ResponseFormat } from '../runtime/engine/api-types.ts';
import type { KvMode } from '../runtime/engine/model-runner.ts';
import { ResponseFormatCompiler } from '../runtime/grammar/constraint.ts';
import { type BenchLoads, forEachBenchLoad } from './engine-runner.ts';
import { runAsEntry } from './machine.ts';
import { promptIds, WEIGHT_MIXES, type WeightMix } from './models.ts';
import { spread } from './stats.ts';

/**
 * The formats timed against plain text. Fields are bounded, so a reply walks through keys, numbers, enums and short
 * strings rather than staying in one string. (`json_object` is left out: greedy decode on random weights closes the
 * object at once, so it times no steps.)
 */
export const BENCH_FORMATS: Record<string, ResponseFormat> = {
  record: {
    type: 'json_schema',
    json_schema: {
      name: 'record',
      schema: {
        type: 'object',
        properties: {
          title: { type: 'string', maxLength: 24 },
          year: { type: 'integer', minimum: 0, maximum: 3000 },
          kind: { enum: ['book', 'article', 'letter'] },
          notes: { type: 'array', items: { type: 'string', maxLength: 12 } },
        },
        required: ['title', 'year', 'kind', 'notes'],
        additionalProperties: false,
      },
    },
  },
  records: {
    type: 'json_schema',
    json_schema: {
      name: 'records',
      schema: {
        type: 'array',
        minItems: 24,
        items: {
          type: 'object',
          properties: {
            id: { type: 'integer', minimum: 0, maximum: 999 },
            tag: { type: 'string', maxLength: 6 },
            ok: { type: 'boolean' },
          },
          required: ['id', 'tag', 'ok'],
          additionalProperties: false,
        },
      },
    },
  },
};

export interface ConstrainedRow {
  model: string;
  weights: WeightMix;
  kv: KvMode;
  context: number;
  format: 'text' | keyof typeof BENCH_FORMATS;
  /** Decode steps timed over all repeats (a format that ends early times fewer). */
  steps: number;
  tpotMs: { median: number; p10: number; p90: number };
  /** Median TPOT ÷ the text row's of the same load. */
  vsText: number | null;
}

export async function runConstrainedBench(
  options: BenchLoads & { context: number; decodeSteps: number; repeats: number },
) {
  const rows: ConstrainedRow[] = [];
  const measured = await forEachBenchLoad(options, options.context, async ({ model: id, weights, kv, engine }) => {
    const runner = engine.engine;
    const compiler = await ResponseFormatCompiler.create(runner.tokenizer.grammarVocabulary(runner.config.vocab));
    try {
      const prompt = promptIds(runner.config.vocab, options.context - options.decodeSteps, 1);
      const formats = ['text', ...Object.keys(BENCH_FORMATS)] as ConstrainedRow['format'][];
      const steps = new Map<string, number[]>(formats.map((f) => [f, []]));
      for (let r = 0; r < options.repeats; r++) {
        for (const format of formats) {
          const constraint =
            format === 'text'
              ? undefined
              : async () => {
                  const c = await compiler.constraint(BENCH_FORMATS[format]);
                  if (!c) throw new Error(`${format} has no constraint`);
                  return c;
                };
          const row = await engine.measure({
            context: options.context,
            decodeSteps: options.decodeSteps,
            repeats: 1,
            fill: 'prefill',
            budgetMs: Number.POSITIVE_INFINITY,
            promptIds: prompt,
            constraint,
          });
          steps.get(format)?.push(...row.stepMs);
        }
      }
      const text = spread(steps.get('text') ?? []).median;
      for (const format of formats) {
        const all = steps.get(format) ?? [];
        const s = spread(all);
        const row: ConstrainedRow = {
          model: id,
          weights,
          kv,
          context: options.context,
          format,
          steps: all.length,
          tpotMs: { median: s.median, p10: s.p10, p90: s.p90 },
          vsText: all.length > 0 ? s.median / text : null,
        };
        rows.push(row);
        options.log(JSON.stringify(row));
      }
    } finally {
      compiler.dispose();
    }
  });
  return { ...measured, rows };
}

export function renderConstrainedMarkdown(rows: readonly ConstrainedRow[]): string {
  const lines = [
    '# Constrained decode: TPOT under a response format ÷ plain text (bench/constrained-decode.ts)',
    '',
    '| model | weights | KV | context | format | steps | TPOT ms (p10–p90) | ÷ text |',
    '| --- | --- | --- | ---: | --- | ---: | ---: | ---: |',
  ];
  for (const r of rows) {
    const t = r.tpotMs;
    lines.push(
      `| ${r.model} | ${r.weights} | ${r.kv} | ${r.context} | ${r.format} | ${r.steps} | ${t.median.toFixed(3)} (${t.p10.toFixed(3)}–${t.p90.toFixed(3)}) | ${r.vsText === null ? '—' : r.vsText.toFixed(3)} |`,
    );
  }
  return `${lines.join('\n')}\n`;
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      models: { type: 'string', default: 'llama-3.2-1b,qwen3-4b' },
      weights: { type: 'string', default: 'q4_0' },
      kv: { type: 'string', default: 'f16,int2' },
      context: { type: 'string', default: '1024' },
      'decode-steps': { type: 'string', default: '64' },
      repeats: { type: 'string', default: '5' },
      'models-dir': { type: 'string', default: join(tmpdir(), 'longtab-bench') },
      out: { type: 'string' },
    },
  });
  const log = (line: string) =>
    process.stderr.write(`[constrained ${new Date().toISOString().slice(11, 19)}] ${line}\n`);
  const weights = values.weights.split(',') as WeightMix[];
  for (const w of weights) if (!WEIGHT_MIXES.includes(w)) throw new Error(`unknown weight mix ${w}`);
  const result = await runConstrainedBench({
    models: values.models.split(','),
    weights,
    kv: values.kv.split(',') as KvMode[],
    context: Number(values.context),
    decodeSteps: Number(values['decode-steps']),
    repeats: Number(values.repeats),
    modelsDir: values['models-dir'],
    log,
  });
  const markdown = renderConstrainedMarkdown(result.rows);
  process.stdout.write(markdown);
  if (values.out) {
    await mkdir(dirname(values.out), { recursive: true });
    const { slug: _, ...report } = result;
    await writeFile(values.out, `${JSON.stringify({ ...report, date: new Date().toISOString() }, null, 1)}\n`);
    await writeFile(values.out.replace(/\.json$/, '.md'), markdown);
  }
}

runAsEntry(import.meta.url, main);
