/**
 * The quick bench runs end to end (longtab on Dawn, llama.cpp on the CPU) and writes a report that matches the
 * schema. No timing is asserted: timings belong in the results, not in tests.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { validateReport } from './report.ts';
import { parseBenchArgs, runBench } from './run.ts';

describe('npm run bench -- --quick', () => {
  const dirs: string[] = [];
  afterAll(async () => {
    for (const dir of dirs) await rm(dir, { recursive: true, force: true });
  });

  it('writes a JSON report matching the schema, with a markdown table', { timeout: 600_000 }, async () => {
    const dir = await mkdtemp(join(tmpdir(), 'longtab-bench-test-'));
    dirs.push(dir);
    const lines: string[] = [];
    const options = parseBenchArgs(
      ['--quick', '--out', dir, '--models-dir', join(dir, 'models'), '--name', 'quick'],
      (l) => lines.push(l),
    );
    const { jsonPath, mdPath } = await runBench(options);
    const report = JSON.parse(await readFile(jsonPath, 'utf8'));
    expect(validateReport(report)).toEqual([]);
    expect(report.finished).toBe(true);
    expect(report.quick).toBe(true);

    const rows = report.rows as Array<{ runtime: string; kv: string; context: number; status: string }>;
    const longtabF16 = rows.filter((r) => r.runtime === 'longtab' && r.kv === 'f16');
    expect(longtabF16.map((r) => [r.context, r.status])).toEqual([
      [64, 'ok'],
      [256, 'ok'],
    ]);
    // int2 is either measured or reported as not available (never silently missing).
    const int2 = rows.filter((r) => r.runtime === 'longtab' && r.kv === 'int2');
    expect(int2).toHaveLength(2);
    for (const r of int2) expect(['ok', 'not available']).toContain(r.status);
    // llama.cpp rows exist for both KV types (CPU build here).
    for (const kv of ['f16', 'q4_0']) {
      expect(rows.filter((r) => r.runtime === 'llama.cpp' && r.kv === kv)).toHaveLength(2);
    }
    const md = await readFile(mdPath, 'utf8');
    expect(md).toContain('| model | weights | runtime |');
    expect(md.split('\n').filter((l) => l.startsWith('| quick-tiny |'))).toHaveLength(rows.length);
  });

  it('rejects a report that lost a field', () => {
    expect(validateReport({ schema: 'longtab-bench/1' }).length).toBeGreaterThan(0);
  });
});
