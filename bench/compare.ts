/**
 * Two bench result files side by side (a change's before and after, from one call of the bench on the same machine):
 * `npx tsx bench/compare.ts BEFORE.json AFTER.json [--out FILE.md]`. One row per longtab row present in both, with
 * prefill and decode tok/s, their ratios, the decode TPOT spread, and the dispatches and queue writes per token.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { markdownTable } from '../tools/markdown-table.ts';
import type { BenchReport, BenchRow } from './report.ts';

const key = (r: BenchRow) => `${r.model}|${r.weights}|${r.kv}|${r.context}`;
const fixed = (x: number | null | undefined, digits = 0) => (x === null || x === undefined ? '–' : x.toFixed(digits));

export function compareReports(before: BenchReport, after: BenchReport): string {
  const rows = (report: BenchReport) =>
    new Map(report.rows.filter((r) => r.runtime === 'longtab' && r.status === 'ok').map((r) => [key(r), r]));
  const earlier = rows(before);
  const table: string[][] = [];
  for (const [k, b] of rows(after)) {
    const a = earlier.get(k);
    if (!a) continue;
    const ratio = (x?: number | null, y?: number | null) => (x && y ? (y / x).toFixed(3) : '–');
    const tpot = (r: BenchRow) => (r.tpotMs ? `${fixed(r.tpotMs.p10, 2)}–${fixed(r.tpotMs.p90, 2)}` : '–');
    table.push([
      b.model,
      b.weights,
      b.kv,
      String(b.context),
      `${fixed(a.prefillTokensPerSecond)} / ${fixed(b.prefillTokensPerSecond)}`,
      ratio(a.prefillTokensPerSecond, b.prefillTokensPerSecond),
      `${fixed(a.decodeTokensPerSecond, 1)} / ${fixed(b.decodeTokensPerSecond, 1)}`,
      ratio(a.decodeTokensPerSecond, b.decodeTokensPerSecond),
      `${tpot(a)} / ${tpot(b)}`,
      `${a.graph?.dispatches ?? '–'} / ${b.graph?.dispatches ?? '–'}`,
      `${fixed(a.graph?.writeBuffersPerToken, 2)} / ${fixed(b.graph?.writeBuffersPerToken, 2)}`,
    ]);
  }
  const header = [
    'model',
    'weights',
    'KV',
    'ctx',
    'prefill tok/s before / after',
    'after ÷ before',
    'decode tok/s before / after',
    'after ÷ before',
    'TPOT ms p10–p90 before / after',
    'dispatches/token',
    'queue writes/token',
  ];
  return [
    `# Bench before and after: ${before.commit.slice(0, 12)} → ${after.commit.slice(0, 12)}`,
    '',
    `Adapter: ${after.adapter.info.description || after.adapter.info.device}; ${after.date} (after).`,
    '',
    ...markdownTable(header, table),
    '',
  ].join('\n');
}

if (process.argv[1] && path.resolve(process.argv[1]) === path.resolve(import.meta.filename)) {
  const { values, positionals } = parseArgs({ allowPositionals: true, options: { out: { type: 'string' } } });
  if (positionals.length !== 2) {
    console.error('usage: npx tsx bench/compare.ts BEFORE.json AFTER.json [--out FILE.md]');
    process.exit(2);
  }
  const [before, after] = positionals.map((p) => JSON.parse(readFileSync(p, 'utf8')) as BenchReport);
  const text = compareReports(before, after);
  if (values.out) writeFileSync(values.out, text);
  else console.log(text);
}
