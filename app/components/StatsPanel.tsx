/**
 * Live numbers: speed (with a tok/s chart), context, GPU memory by category as the allocator counts it, and the KV
 * kept outside the GPU (host memory, the KV store).
 */
import type { EngineStats, ModelInfo } from '../engine/types.ts';
import { formatBytes } from '../storage/models.ts';
import { adapterLabel, softwareAdapterName } from './adapter-note.ts';
import { kvHoldsText, kvHostText, kvPlanText, kvReuseText, kvStoredText, type PromptReuse } from './kv-summary.ts';

export interface PerfSample {
  t: number;
  tps: number;
}

export interface Perf {
  prefillTps: number | null;
  decodeTps: number | null;
  ttftMs: number | null;
  tpotMs: number | null;
  tokens: number;
  live: boolean;
  series: PerfSample[];
  /** The last reply's prompt: its tokens and those the KV cache had (null until a reply's usage comes). */
  prompt: PromptReuse | null;
}

export const EMPTY_PERF: Perf = {
  prefillTps: null,
  decodeTps: null,
  ttftMs: null,
  tpotMs: null,
  tokens: 0,
  live: false,
  series: [],
  prompt: null,
};

function num(value: number | null, digits = 1, unit = ''): string {
  if (value === null || !Number.isFinite(value)) return '—';
  return `${value.toFixed(digits)}${unit}`;
}

function Chart({ series }: { series: PerfSample[] }) {
  const width = 260;
  const height = 64;
  if (series.length < 2) {
    return (
      <svg className="chart" viewBox={`0 0 ${width} ${height}`} role="img" aria-label="tokens per second over time">
        <text x={width / 2} y={height / 2 + 4} textAnchor="middle" className="chart-empty">
          tok/s appears while a reply streams
        </text>
      </svg>
    );
  }
  const t0 = series[0]!.t;
  const span = Math.max(1, series[series.length - 1]!.t - t0);
  const max = Math.max(1, ...series.map((s) => s.tps));
  const points = series.map(
    (s) => `${(((s.t - t0) / span) * width).toFixed(1)},${(height - 4 - (s.tps / max) * (height - 12)).toFixed(1)}`,
  );
  return (
    <svg
      className="chart"
      viewBox={`0 0 ${width} ${height}`}
      role="img"
      aria-label="tokens per second over time"
      data-testid="tps-chart"
    >
      <polyline className="chart-area" points={`0,${height} ${points.join(' ')} ${width},${height}`} />
      <polyline className="chart-line" points={points.join(' ')} />
      <text x={4} y={12} className="chart-label">
        max {max.toFixed(1)} tok/s
      </text>
    </svg>
  );
}

function Bar({ label, bytes, max, kind }: { label: string; bytes: number; max: number; kind: string }) {
  const share = max > 0 ? Math.min(1, bytes / max) : 0;
  return (
    <div className="bar-row" data-testid={`mem-${kind}`}>
      <div className="bar-label">
        <span>{label}</span>
        <span>{formatBytes(bytes)}</span>
      </div>
      <div className="bar">
        <div className={`bar-fill bar-${kind}`} style={{ width: `${(share * 100).toFixed(1)}%` }} />
      </div>
    </div>
  );
}

function Metric({ label, value, testId }: { label: string; value: string; testId: string }) {
  return (
    <div className="metric">
      <div className="metric-value" data-testid={testId}>
        {value}
      </div>
      <div className="metric-label">{label}</div>
    </div>
  );
}

/** Average bits per cached element of the tokens held now (int2 pages plus the f16 sink/window and page slack). */
export function kvBitsHeld(stats: EngineStats | null): number | null {
  if (!stats) return null;
  const { memory, kv } = stats;
  if (kv.mode === 'f16') return 16;
  return memory.kvF16Equivalent > 0 ? (memory.kvUsed * 8) / (memory.kvF16Equivalent / 2) : null;
}

export function StatsPanel({ stats, perf, model }: { stats: EngineStats | null; perf: Perf; model: ModelInfo | null }) {
  const memory = stats?.memory;
  const context = stats?.context;
  const bits = kvBitsHeld(stats);
  const holds = kvHoldsText(stats);
  const plan = kvPlanText(stats);
  const reuse = kvReuseText(perf.prompt);
  const maxBytes = memory ? Math.max(memory.weights, memory.kvReserved, memory.scratch, 1) : 1;
  const used = context?.used ?? 0;
  const capacity = context?.capacity ?? model?.contextCapacity ?? 0;
  return (
    <aside className="stats" aria-label="Live stats" data-testid="stats-panel">
      <h2>Live stats {perf.live && <span className="live-dot" title="generating" />}</h2>
      <section>
        <h3>Speed</h3>
        <div className="metrics">
          <Metric label="prefill tok/s" value={num(perf.prefillTps)} testId="stat-prefill" />
          <Metric label="decode tok/s" value={num(perf.decodeTps)} testId="stat-decode" />
          <Metric label="TTFT" value={num(perf.ttftMs, 0, ' ms')} testId="stat-ttft" />
          <Metric label="TPOT" value={num(perf.tpotMs, 0, ' ms')} testId="stat-tpot" />
        </div>
        <Chart series={perf.series} />
      </section>
      <section>
        <h3>Context</h3>
        <div className="context-line" data-testid="stat-context">
          <strong>{used.toLocaleString()}</strong> / {capacity.toLocaleString()} tokens
        </div>
        <div className="bar">
          <div
            className="bar-fill bar-kv"
            style={{ width: `${capacity ? Math.min(100, (used / capacity) * 100) : 0}%` }}
          />
        </div>
        {holds && (
          <p className="hint" data-testid="stat-kv-holds">
            {holds}
          </p>
        )}
        {plan && (
          <p className="hint" data-testid="stat-kv-plan">
            {plan}
          </p>
        )}
        {reuse && (
          <p className="hint" data-testid="stat-kv-reuse">
            {reuse}
          </p>
        )}
      </section>
      <section>
        <h3>
          GPU memory <span className="muted">{memory ? formatBytes(memory.total) : ''}</span>
        </h3>
        {memory ? (
          <>
            <Bar label="weights" bytes={memory.weights} max={maxBytes} kind="weights" />
            <Bar label="KV used" bytes={memory.kvUsed} max={maxBytes} kind="kv" />
            <Bar label="KV reserved" bytes={memory.kvReserved} max={maxBytes} kind="kv-reserved" />
            <Bar label="scratch" bytes={memory.scratch} max={maxBytes} kind="scratch" />
          </>
        ) : (
          <p className="hint">Load a model to see memory.</p>
        )}
        <dl className="facts">
          <dt>KV mode</dt>
          <dd data-testid="stat-kv-mode">{stats?.kv.mode ?? model?.kv ?? '—'}</dd>
          <dt>KV bits / element held</dt>
          <dd data-testid="stat-kv-bits">{bits === null ? '—' : bits.toFixed(bits === 16 ? 0 : 2)}</dd>
          <dt>KV held as f16 would be</dt>
          <dd>{memory ? formatBytes(memory.kvF16Equivalent) : '—'}</dd>
          <dt>KV in host memory</dt>
          <dd data-testid="stat-kv-host">{kvHostText(stats) ?? 'off'}</dd>
          <dt title="This model's conversations whose KV is kept on this device (OPFS) to resume after a reload">
            KV stored on this device
          </dt>
          <dd data-testid="stat-kv-stored">{kvStoredText(stats) ?? 'off'}</dd>
          <dt>peak</dt>
          <dd>{memory ? formatBytes(memory.peak) : '—'}</dd>
          <dt>GPU</dt>
          <dd data-testid="stat-adapter">
            {stats?.adapter
              ? `${adapterLabel(stats.adapter)}${softwareAdapterName(stats.adapter) ? ' (software)' : ''}`
              : '—'}
          </dd>
        </dl>
      </section>
    </aside>
  );
}
