/**
 * The quick bench runs end to end (longtab on Dawn, llama.cpp on the CPU) and writes a report that matches the
 * schema. No timing is asserted: timings belong in the results, not in tests.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { defaultPrefillChunk } from '../runtime/engine/model-runner.ts';
import { BENCH_FORMATS, runConstrainedBench } from './constrained-decode.ts';
import { benchKvBudgetBytes } from './engine-runner.ts';
import { RESUME_PATHS, runResumeBench } from './kv-resume.ts';
import { BENCH_MODELS } from './models.ts';
import { renderMarkdown, validateReport } from './report.ts';
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
      // 8192 is past the quick model's context length (4096): every runtime's row there is skipped, saying so.
      ['--quick', '--contexts', '64,256,8192', '--out', dir, '--models-dir', join(dir, 'models'), '--name', 'quick'],
      (l) => lines.push(l),
    );
    const { jsonPath, mdPath } = await runBench(options);
    const report = JSON.parse(await readFile(jsonPath, 'utf8'));
    expect(validateReport(report)).toEqual([]);
    expect(report.finished).toBe(true);
    expect(report.quick).toBe(true);

    const rows = report.rows as Array<{
      runtime: string;
      kv: string;
      context: number;
      status: string;
      reason?: string;
      prefillChunk?: number;
      decodeTokensPerSecond?: number;
      vsOwnF16?: { decode: number };
    }>;
    const past = rows.filter((r) => r.context === 8192);
    expect(past).toHaveLength(4);
    for (const r of past) expect([r.status, r.reason]).toEqual(['skipped', "beyond the model's context length (4096)"]);
    const longtabF16 = rows.filter((r) => r.runtime === 'longtab' && r.kv === 'f16' && r.context < 8192);
    expect(longtabF16.map((r) => [r.context, r.status])).toEqual([
      [64, 'ok'],
      [256, 'ok'],
    ]);
    // int2 is either measured or reported as not available (never silently missing); measured, it carries its decode
    // rate over the f16 row's of the same context.
    const int2 = rows.filter((r) => r.runtime === 'longtab' && r.kv === 'int2' && r.context < 8192);
    expect(int2).toHaveLength(2);
    for (const r of int2) {
      expect(['ok', 'not available']).toContain(r.status);
      if (r.status !== 'ok') continue;
      const f16 = longtabF16.find((f) => f.context === r.context)!;
      expect(r.vsOwnF16?.decode).toBeCloseTo(r.decodeTokensPerSecond! / f16.decodeTokensPerSecond!, 10);
    }
    expect(longtabF16.every((r) => r.vsOwnF16 === undefined)).toBe(true);
    // Each longtab row records its prefill chunk, and the int2 load's budget gives it the chunk the f16 load takes
    // (a budget too small for it once left the 2-bit rows of short contexts on smaller chunks).
    for (const r of [...longtabF16, ...int2].filter((r) => r.status === 'ok')) {
      expect(r.prefillChunk).toBe(longtabF16[0].prefillChunk);
      expect(r.prefillChunk).toBeGreaterThan(0);
    }
    // llama.cpp rows exist for both KV types (CPU build here).
    for (const kv of ['f16', 'q4_0']) {
      expect(rows.filter((r) => r.runtime === 'llama.cpp' && r.kv === kv)).toHaveLength(3);
    }
    const md = await readFile(mdPath, 'utf8');
    expect(md).toContain('| model | weights | runtime |');
    expect(md.split('\n').filter((l) => l.startsWith('| quick-tiny |'))).toHaveLength(rows.length);
  });

  it('marks prefill numbers a stalled repeat moved, and the ratios against them (a real H200 report)', async () => {
    // Two repeats per row: llama.cpp's first row (Q4_K_M, f16 cache, 1K) stalled 6 s in one of them.
    const report = JSON.parse(
      await readFile(new URL('./results/2026-11-30-nvidia-h200-session9-qwen3-4b.json', import.meta.url), 'utf8'),
    );
    const md = renderMarkdown(report).split('\n');
    const line = (runtime: string, weights: string, kv: string, context: number) =>
      md.find((l) => l.startsWith(`| qwen3-4b | ${weights} | ${runtime} | ${kv} | ${context} |`)) ?? '';
    const cells = (l: string) => l.split('|').map((c) => c.trim());
    expect(cells(line('llama.cpp', 'q4_k_m', 'f16', 1024))[8]).toMatch(/⚠$/); // TTFT
    expect(cells(line('longtab', 'q4_k_m', 'f16', 1024))[17]).toMatch(/× ⚠$/); // prefill ×llama f16
    expect(cells(line('longtab', 'q4_k_m', 'f16', 1024))[8]).not.toContain('⚠');
    expect(cells(line('llama.cpp', 'q4_0', 'f16', 1024))[8]).not.toContain('⚠');
    expect(cells(line('longtab', 'q4_0', 'f16', 1024))[17]).not.toContain('⚠');
    expect(md.some((l) => l.startsWith('- ⚠: the median TTFT'))).toBe(true);
  });

  it('rejects a report that lost a field', () => {
    expect(validateReport({ schema: 'longtab-bench/1' }).length).toBeGreaterThan(0);
  });

  it("gives a 2-bit load's short contexts the prefill chunk long ones take (1024 tokens on tensor cores)", () => {
    // As the engine builds the pool for a bench load (kvPoolOptions: sink 64, window 256, two sequences).
    for (const shape of BENCH_MODELS) {
      for (const context of [1024, 8192, 32768]) {
        const pool = {
          layers: shape.layers,
          kvHeads: shape.kvHeads,
          headDim: shape.headDim,
          budgetBytes: benchKvBudgetBytes(shape, 'int2', context),
          kv: 'quant' as const,
          sink: 64,
          window: 256,
          maxSequences: 2,
        };
        expect(defaultPrefillChunk(true, pool), `${shape.id} at ${context}`).toBe(1024);
      }
    }
  });
});

describe('bench/constrained-decode.ts', () => {
  it('times text and each format on one load; a format row is its median over the text row', {
    timeout: 300_000,
  }, async () => {
    const dir = await mkdtemp(join(tmpdir(), 'longtab-constrained-test-'));
    try {
      const { rows } = await runConstrainedBench({
        models: ['quick-tiny'],
        weights: ['q4_0'],
        kv: ['f16'],
        context: 96,
        decodeSteps: 6,
        repeats: 2,
        modelsDir: dir,
        log: () => {},
      });
      expect(rows.map((r) => r.format)).toEqual(['text', ...Object.keys(BENCH_FORMATS)]);
      const text = rows[0];
      expect(text.steps).toBe(2 * 6);
      expect(text.vsText).toBe(1);
      for (const row of rows.slice(1)) {
        expect(row.steps).toBeGreaterThan(0);
        expect(row.vsText).toBeCloseTo(row.tpotMs.median / text.tpotMs.median, 12);
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('npm run bench -- --calibrate', () => {
  it("parses the switch, and the table names each calibrated row set's plan and its bits", async () => {
    expect(parseBenchArgs(['--quick', '--calibrate', '--kv', 'int2'], () => {}).calibrate).toBe(true);
    expect(parseBenchArgs(['--quick'], () => {}).calibrate).toBe(false);
    const report = JSON.parse(
      await readFile(new URL('./results/2026-11-30-nvidia-h200-session9-qwen3-4b.json', import.meta.url), 'utf8'),
    );
    const plan = { summary: 'K 2-bit clip 0.92, V 2-bit clip 0.92', source: 'calibration', bitsPerElementAt32K: 2.39 };
    for (const row of report.rows) if (row.kv === 'int2' && row.weights === 'q4_0') row.kvPlan = plan;
    const notes = renderMarkdown(report)
      .split('\n')
      .filter((l) => l.includes(': plan '));
    expect(notes).toEqual([
      '- qwen3-4b q4_0 int2: plan K 2-bit clip 0.92, V 2-bit clip 0.92 (calibration; 2.39 bits per element at 32K).',
    ]);
  });
});

describe('bench/kv-resume.ts', () => {
  it('times a follow-up turn from each tier; host and store bring the pages back bit for bit, and answer alike', {
    timeout: 300_000,
  }, async () => {
    const dir = await mkdtemp(join(tmpdir(), 'longtab-resume-test-'));
    try {
      const { rows } = await runResumeBench({
        models: ['quick-tiny'],
        weights: ['q4_0'],
        kv: ['f16', 'int2'],
        // Past the 2-bit cache's sink and window (320 positions), so that most pages are 2-bit.
        context: 800,
        followUp: 16,
        continuation: 4,
        repeats: 1,
        modelsDir: dir,
        log: () => {},
      });
      expect(rows.map((r) => `${r.kv} ${r.path}`)).toEqual(
        ['f16', 'int2'].flatMap((kv) => RESUME_PATHS.map((path) => `${kv} ${path}`)),
      );
      for (const row of rows) {
        expect(row.ttftMs.all).toHaveLength(1);
        expect(row.ttftMs.median).toBeGreaterThan(0);
        expect(row.bytes).toBeGreaterThan(0);
        if (row.path === 'host' || row.path === 'store') {
          expect(row.bitExact, `${row.kv} ${row.path}`).toBe(true);
          expect(row.sameContinuation, `${row.kv} ${row.path}`).toBe(true);
          expect(row.saveMs).not.toBeNull();
        }
        if (row.path === 'prefill') expect(row.vsPrefill).toBe(1);
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
