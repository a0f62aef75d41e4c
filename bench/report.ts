/**
 * The benchmark's result file (`bench/results/<date>-<adapter>.json`), its markdown table, and a schema check the
 * test suite runs on the quick bench's output. One row = one runtime × model × weight mix × KV type × context.
 */

import type { MemorySnapshot } from '../core/gpu/allocator.ts';
import type { PrefillAttention } from '../runtime/engine/api-types.ts';
import type { PrefillMatmul } from '../runtime/model/transformer.ts';
import type { DecodeGraphCounts, FillMode } from './engine-runner.ts';
import type { LlamaInfo } from './llama-cpp.ts';
import type { Spread } from './stats.ts';

export const REPORT_SCHEMA = 'longtab-bench/1';

export type RowStatus = 'ok' | 'not available' | 'skipped' | 'error';

export interface BenchRow {
  runtime: 'longtab' | 'llama.cpp';
  model: string;
  weights: string;
  /** longtab: 'f16' | 'int2'; llama.cpp: 'f16' | 'q4_0'. */
  kv: string;
  context: number;
  status: RowStatus;
  reason?: string;
  /** Prompt tokens prefilled (context − decodeSteps); the KV holds `context` positions after the last step. */
  promptTokens?: number;
  decodeSteps?: number;
  fill?: FillMode;
  /** longtab: the prefill chunk the engine ran with (its default for the load's KV budget, or --prefill-chunk). */
  prefillChunk?: number;
  repeats?: number;
  repeatsRequested?: number;
  prefillTokensPerSecond?: number | null;
  prefillSpread?: Spread | null;
  ttftMs?: Spread | null;
  tpotMs?: Spread;
  decodeTokensPerSecond?: number;
  kvBytesPerToken?: number;
  /** longtab: the allocator's total after the run; llama.cpp: the device's VRAM use increase since before the model
   * was loaded, i.e. model + context (null on CPU). */
  gpuMemoryBytes?: number | null;
  memory?: MemorySnapshot;
  kvPool?: { bytesUsed: number; bytesReserved: number; slabs: number; pageTokens: number; pageBytes: number };
  /** Per decode token: weights read once + KV up to the mean decode position. */
  decodeBytesPerToken?: { weights: number; kv: number; total: number };
  /** decodeBytesPerToken.total / median TPOT, in GB/s (1e9 bytes). */
  achievedGBps?: number;
  graph?: DecodeGraphCounts;
  /** longtab rows: this row ÷ llama.cpp's row of the same model, weights and context, per llama.cpp KV type. */
  vsLlama?: Record<string, { decode: number | null; prefill: number | null; ttft: number | null }>;
  /** longtab rows of another KV mode: decode tok/s ÷ the longtab f16 row's of the same model, weights and context. */
  vsOwnF16?: { decode: number };
  /** longtab quant rows: the cache's precision plan (stats().kv.plan: 'calibration' with --calibrate). */
  kvPlan?: { summary: string; source: string; bitsPerElementAt32K: number };
}

export interface BenchModelEntry {
  id: string;
  name: string;
  weights: string;
  shape: {
    layers: number;
    dim: number;
    heads: number;
    kvHeads: number;
    headDim: number;
    ffnDim: number;
    vocab: number;
  };
  fileBytes: number;
  typeCounts: Record<string, number>;
  generated: boolean;
  generateSeconds: number;
  path: string;
}

export interface BenchReport {
  schema: typeof REPORT_SCHEMA;
  date: string;
  quick: boolean;
  finished: boolean;
  /** Git commit of the bench and runtime that ran (`+dirty`: uncommitted changes; `+worktree`: bundled from them). */
  commit: string;
  host: { platform: string; arch: string; cpus: number; cpuModel: string; node: string; memoryBytes: number };
  adapter: {
    info: Record<string, unknown>;
    features: string[];
    limits: Record<string, number>;
    deviceFeatures: string[];
  };
  protocol: {
    contexts: number[];
    decodeSteps: number;
    repeats: number;
    warmup: string;
    timed: string;
    fill: string;
    prefillChunk: number | null;
    /** Which kernels ran the prefill projections ('auto': int8 tensor cores where the adapter offers them). */
    prefillMatmul?: PrefillMatmul;
    /** Which products ran the prefill attention ('auto': int8 tensor cores where the adapter offers them). */
    prefillAttention?: PrefillAttention;
    rowBudgetSeconds: number;
    prefillLimitSeconds: number;
    seed: number;
    llama: string;
    /** int2 rows ran with the plan and rotations the engine's calibration fits (--calibrate), else Hadamard. */
    calibrate?: boolean;
  };
  llama: (LlamaInfo & { available: true }) | { available: false; reason: string };
  models: BenchModelEntry[];
  rows: BenchRow[];
  notes: string[];
}

const MiB = 2 ** 20;

function fmt(value: number | null | undefined, digits = 1): string {
  if (value === null || value === undefined || !Number.isFinite(value)) return '–';
  if (Math.abs(value) >= 1000) return value.toFixed(0);
  return value.toFixed(digits);
}

function ratio(value: number | null | undefined): string {
  return value === null || value === undefined || !Number.isFinite(value) ? '–' : `${value.toFixed(2)}×`;
}

/**
 * Whether a row's median TTFT is over twice its fastest repeat's: a stall in one repeat moved the median. Seen in the
 * first llama.cpp row of every H200 call of session 9 (one repeat of several seconds); with 3 or more repeats the
 * median leaves one stall out.
 */
export function stalledTtft(r: BenchRow): boolean {
  const t = r.ttftMs;
  return r.status === 'ok' && t !== null && t !== undefined && t.median > 2 * t.min;
}

/** The markdown table of a report (also printed at the end of a run). */
export function renderMarkdown(report: BenchReport): string {
  const a = report.adapter.info;
  const lines: string[] = [];
  lines.push(`# longtab bench ${report.date}${report.quick ? ' (quick)' : ''}, commit ${report.commit.slice(0, 12)}`);
  lines.push('');
  lines.push(
    `Adapter: ${String(a.vendor ?? '')} ${String(a.device ?? '')} (${String(a.description ?? '')}, architecture ${String(a.architecture ?? '')}` +
      `${a.isFallbackAdapter ? ', fallback' : ''}); maxBufferSize ${fmt(report.adapter.limits.maxBufferSize / MiB, 0)} MiB, ` +
      `maxStorageBufferBindingSize ${fmt(report.adapter.limits.maxStorageBufferBindingSize / MiB, 0)} MiB; ` +
      `device features: ${report.adapter.deviceFeatures.join(', ') || 'none'}.`,
  );
  lines.push(
    `Host: ${report.host.cpuModel} (${report.host.cpus} cores), Node ${report.host.node}. llama.cpp: ` +
      (report.llama.available
        ? `${report.llama.backend} (${report.llama.gpuDevices.join(', ') || 'CPU'}), ${report.llama.llamaCppRelease}, threads ${report.llama.threads}, batch ${report.llama.batchSize}, flash attention ${report.llama.flashAttention ? 'on' : 'off'}.`
        : `not run (${report.llama.reason}).`),
  );
  const p = report.protocol;
  lines.push(
    `Protocol: contexts ${p.contexts.join('/')}; prompt = context − ${p.decodeSteps} tokens, then ${p.decodeSteps} decode steps; ` +
      `up to ${p.repeats} repeats after warm-up (${p.warmup}); fill: ${p.fill}. ${report.finished ? '' : '**Run incomplete.**'}`,
  );
  lines.push('');
  lines.push(
    '| model | weights | runtime | KV | ctx | fill | prefill tok/s | TTFT ms | decode tok/s | TPOT ms median (p10–p90) | KV B/tok | GPU MiB | read MB/tok | GB/s | dispatches per tok (a layer) / submits | decode ×llama f16 / q4_0 | prefill ×llama f16 | decode ÷ own f16 |',
  );
  lines.push(
    '| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: |',
  );
  const stalledLlama = new Set(
    report.rows
      .filter((r) => r.runtime === 'llama.cpp' && r.kv === 'f16' && stalledTtft(r))
      .map((r) => `${r.model}|${r.weights}|${r.context}`),
  );
  const mark = (stalled: boolean) => (stalled ? ' ⚠' : '');
  // The forward body's dispatches over the model's layers (the body's few outside the layers, the embedding's, count
  // in too); '?' where the report has no entry for the model.
  const layersOf = new Map(report.models.map((m) => [m.id, m.shape.layers]));
  const perLayer = (model: string, g: DecodeGraphCounts) => {
    const layers = layersOf.get(model);
    return layers ? fmt(g.forwardDispatches / layers, 1) : '?';
  };
  let marked = false;
  for (const r of report.rows) {
    if (r.status !== 'ok') {
      lines.push(
        `| ${r.model} | ${r.weights} | ${r.runtime} | ${r.kv} | ${r.context} | ${r.status} | ${(r.reason ?? '').replaceAll('|', '/').slice(0, 120)} | | | | | | | | | | | |`,
      );
      continue;
    }
    const tpot = r.tpotMs!;
    const g = r.graph;
    const stalled = stalledTtft(r);
    const againstStalled = r.vsLlama !== undefined && stalledLlama.has(`${r.model}|${r.weights}|${r.context}`);
    marked ||= stalled || againstStalled;
    lines.push(
      [
        r.model,
        r.weights,
        r.runtime,
        r.kv,
        String(r.context),
        r.fill ?? 'prefill',
        fmt(r.prefillTokensPerSecond) + mark(stalled),
        fmt(r.ttftMs?.median) + mark(stalled),
        fmt(r.decodeTokensPerSecond),
        `${fmt(tpot.median, 2)} (${fmt(tpot.p10, 2)}–${fmt(tpot.p90, 2)})`,
        fmt(r.kvBytesPerToken, 0),
        r.gpuMemoryBytes === null || r.gpuMemoryBytes === undefined ? '–' : fmt(r.gpuMemoryBytes / MiB, 0),
        fmt((r.decodeBytesPerToken?.total ?? Number.NaN) / 1e6),
        fmt(r.achievedGBps, 2),
        g ? `${g.dispatches} (${perLayer(r.model, g)}) / ${fmt(g.submitsPerToken, 0)}` : '–',
        r.vsLlama ? `${ratio(r.vsLlama.f16?.decode)} / ${ratio(r.vsLlama.q4_0?.decode)}` : '',
        r.vsLlama ? ratio(r.vsLlama.f16?.prefill) + mark(againstStalled) : '',
        r.vsOwnF16 ? fmt(r.vsOwnF16.decode, 2) : '',
      ]
        .join(' | ')
        .replace(/^/, '| ')
        .replace(/$/, ' |'),
    );
  }
  const notes = [...report.notes];
  const plans = new Map<string, NonNullable<BenchRow['kvPlan']>>();
  for (const r of report.rows) if (r.kvPlan) plans.set(`${r.model} ${r.weights} ${r.kv}`, r.kvPlan);
  for (const [row, plan] of plans) {
    notes.push(
      `${row}: plan ${plan.summary} (${plan.source}; ${plan.bitsPerElementAt32K.toFixed(2)} bits per element at 32K).`,
    );
  }
  if (marked) {
    notes.push(
      '⚠: the median TTFT is over twice the fastest repeat (a stall in one repeat moved it): that prefill rate, and prefill ratios against that llama.cpp row, are unreliable; rerun with 3 or more repeats.',
    );
  }
  if (notes.length > 0) {
    lines.push('');
    for (const note of notes) lines.push(`- ${note}`);
  }
  lines.push('');
  return lines.join('\n');
}

/** Problems with a report's shape (empty when it matches the schema). No timing values are judged. */
export function validateReport(value: unknown): string[] {
  const problems: string[] = [];
  const isObject = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null;
  const need = (cond: boolean, what: string) => {
    if (!cond) problems.push(what);
  };
  if (!isObject(value)) return ['report is not an object'];
  const r = value;
  need(r.schema === REPORT_SCHEMA, `schema is ${String(r.schema)}`);
  need(typeof r.date === 'string' && !Number.isNaN(Date.parse(r.date as string)), 'date is not an ISO date');
  need(typeof r.quick === 'boolean' && typeof r.finished === 'boolean', 'quick/finished are not booleans');
  need(typeof r.commit === 'string', 'commit missing');
  need(isObject(r.host) && typeof r.host.node === 'string', 'host.node missing');
  const adapter = r.adapter;
  need(
    isObject(adapter) && isObject(adapter.info) && Array.isArray(adapter.features) && isObject(adapter.limits),
    'adapter info/features/limits missing',
  );
  if (isObject(adapter) && isObject(adapter.limits)) {
    for (const k of ['maxBufferSize', 'maxStorageBufferBindingSize'])
      need(typeof adapter.limits[k] === 'number', `adapter.limits.${k} missing`);
  }
  need(isObject(r.protocol) && Array.isArray(r.protocol.contexts), 'protocol.contexts missing');
  need(isObject(r.llama) && typeof r.llama.available === 'boolean', 'llama.available missing');
  need(Array.isArray(r.models) && r.models.length > 0, 'no models');
  if (!Array.isArray(r.rows)) return [...problems, 'rows is not an array'];
  r.rows.forEach((row: unknown, i: number) => {
    if (!isObject(row)) {
      problems.push(`rows[${i}] is not an object`);
      return;
    }
    const at = `rows[${i}] (${String(row.runtime)} ${String(row.model)} ${String(row.kv)} ${String(row.context)})`;
    need(row.runtime === 'longtab' || row.runtime === 'llama.cpp', `${at}: runtime`);
    need(typeof row.model === 'string' && typeof row.weights === 'string' && typeof row.kv === 'string', `${at}: ids`);
    need(Number.isInteger(row.context) && (row.context as number) > 0, `${at}: context`);
    need(['ok', 'not available', 'skipped', 'error'].includes(row.status as string), `${at}: status`);
    if (row.status !== 'ok') {
      need(typeof row.reason === 'string' && row.reason.length > 0, `${at}: a row that is not ok needs a reason`);
      return;
    }
    const positive = (v: unknown) => typeof v === 'number' && Number.isFinite(v) && v > 0;
    need(positive(row.decodeTokensPerSecond), `${at}: decodeTokensPerSecond`);
    need(isObject(row.tpotMs) && positive(row.tpotMs.median) && positive(row.tpotMs.count), `${at}: tpotMs`);
    need(positive(row.kvBytesPerToken), `${at}: kvBytesPerToken`);
    need(positive(row.promptTokens) && positive(row.decodeSteps), `${at}: promptTokens/decodeSteps`);
    need(positive(row.repeats), `${at}: repeats`);
    need(isObject(row.decodeBytesPerToken) && positive(row.decodeBytesPerToken.total), `${at}: decodeBytesPerToken`);
    need(positive(row.achievedGBps), `${at}: achievedGBps`);
    if (row.fill === 'prefill') {
      need(positive(row.prefillTokensPerSecond), `${at}: prefillTokensPerSecond`);
      need(isObject(row.ttftMs) && positive(row.ttftMs.median), `${at}: ttftMs`);
    }
    if (row.runtime === 'longtab') {
      need(positive(row.gpuMemoryBytes), `${at}: gpuMemoryBytes`);
      need(isObject(row.memory) && isObject(row.memory.bytes), `${at}: memory snapshot`);
      const g = row.graph;
      need(isObject(g) && positive(g.dispatches) && positive(g.submitsPerToken), `${at}: graph counts`);
      need(isObject(row.vsLlama), `${at}: vsLlama`);
    }
  });
  return problems;
}
