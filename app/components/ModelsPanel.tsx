/**
 * Model management: presets from the hub, the demo model, any URL, a local file; stored models; storage quota; the
 * conversations' stored KV and a way to clear it.
 */

import { useCallback, useEffect, useState } from 'react';
import { errorMessage } from '../engine/engine-client.ts';
import type { StoredKvUsage } from '../engine/types.ts';
import { fitLabel, type GpuEvidence, gpuMemoryParts, modelFit } from '../models/model-fit.ts';
import { DEMO_MODEL_ID, DEMO_MODEL_NAME, MODEL_PRESETS, type ModelPreset, presetGpuMemory } from '../models/presets.ts';
import { formatBytes, formatDuration, type StoredModel } from '../storage/models.ts';
import type { DownloadState, ModelsApi } from '../storage/use-models.ts';
import { Modal } from './Modal.tsx';

function ProgressBar({ state, total }: { state: DownloadState; total: number | null }) {
  const bytesTotal = state.bytesTotal ?? total;
  const share = bytesTotal ? state.bytesDone / bytesTotal : 0;
  return (
    <div className="download" data-testid="download-progress">
      <div className="bar">
        <div className="bar-fill bar-weights" style={{ width: `${(share * 100).toFixed(1)}%` }} />
      </div>
      <div className="download-text">
        {formatBytes(state.bytesDone)}
        {bytesTotal ? ` of ${formatBytes(bytesTotal)}` : ''} · {state.speed > 0 ? `${formatBytes(state.speed)}/s` : '—'}{' '}
        · {state.secondsLeft === null ? 'estimating…' : `${formatDuration(state.secondsLeft)} left`}
      </div>
    </div>
  );
}

/** What the picker weighs each model against: the KV budget from settings and what the engine knows of the GPU. */
export interface FitContext {
  kvBudgetBytes: number;
  gpu: GpuEvidence | null;
  /** The model loaded now with the current KV budget. */
  runningModelId: string | null;
}

function FitLabel({
  modelId,
  modelBytes,
  scratchBytes,
  context,
}: {
  modelId: string;
  modelBytes: number | null;
  scratchBytes?: number;
  context: FitContext;
}) {
  const fit = modelFit(
    { modelBytes, kvBudgetBytes: context.kvBudgetBytes, scratchBytes, running: modelId === context.runningModelId },
    context.gpu,
  );
  return (
    <div
      className={`fit fit-${fit.verdict} small`}
      data-testid="model-fit"
      data-verdict={fit.verdict}
      title={fit.reason}
    >
      {fitLabel(fit)}
    </div>
  );
}

function StoredRow({
  model,
  api,
  selected,
  onSelect,
  fit,
}: {
  model: StoredModel;
  api: ModelsApi;
  selected: boolean;
  onSelect: (id: string) => void;
  fit: FitContext;
}) {
  const download = api.downloads[model.id];
  return (
    <li className={`stored ${selected ? 'selected' : ''}`} data-testid="stored-model" data-model-id={model.id}>
      <div className="stored-main">
        <div className="stored-name">{model.name}</div>
        <div className="muted small">
          {model.complete
            ? `${formatBytes(model.totalBytes ?? model.storedBytes)} · stored`
            : download
              ? 'downloading…'
              : `${formatBytes(model.storedBytes)}${model.totalBytes ? ` of ${formatBytes(model.totalBytes)}` : ''} · incomplete`}
          {model.error ? ` · ${model.error}` : ''}
        </div>
        <FitLabel
          modelId={model.id}
          modelBytes={model.totalBytes ?? (model.complete ? model.storedBytes : null)}
          context={fit}
        />
        {download && <ProgressBar state={download} total={model.totalBytes} />}
      </div>
      <div className="stored-actions">
        {model.complete && (
          <button type="button" className="primary" onClick={() => onSelect(model.id)} disabled={selected}>
            {selected ? 'Selected' : 'Use'}
          </button>
        )}
        {!model.complete && model.url && !download && (
          <button type="button" onClick={() => void api.resume(model.id)}>
            Resume
          </button>
        )}
        {download && (
          <button type="button" onClick={() => api.pause(model.id)}>
            Pause
          </button>
        )}
        <button
          type="button"
          className="danger"
          onClick={() => void api.remove(model.id)}
          aria-label={`Delete ${model.name}`}
        >
          Delete
        </button>
      </div>
    </li>
  );
}

/**
 * A hub preset: where it comes from, its download size and the GPU memory it takes at most with the current KV budget
 * (the sum the fit label weighs; its parts in the tooltip).
 */
export function PresetRow({
  preset,
  fit,
  stored,
  onDownload,
}: {
  preset: ModelPreset;
  fit: FitContext;
  /** Whether it is in the stored list already, whole or not. */
  stored: 'complete' | 'incomplete' | null;
  onDownload: () => void;
}) {
  const memory = presetGpuMemory(preset, fit.kvBudgetBytes);
  return (
    <li className="preset" data-testid={`preset-${preset.id}`}>
      <div>
        <div className="stored-name">{preset.label}</div>
        <div className="muted small">
          {preset.repo} · {preset.file} · ≈{formatBytes(preset.approxBytes)} (approx.) ·{' '}
          <span data-testid="preset-gpu-memory" title={gpuMemoryParts(memory)}>
            ≈{formatBytes(memory.total)} GPU memory
          </span>{' '}
          · {preset.note}
        </div>
        <FitLabel modelId={preset.id} modelBytes={preset.approxBytes} scratchBytes={memory.scratch} context={fit} />
      </div>
      <button type="button" disabled={stored !== null} onClick={onDownload}>
        {stored === 'complete' ? 'Stored' : stored === 'incomplete' ? 'In list' : 'Download'}
      </button>
    </li>
  );
}

/** The conversations' stored KV: what it takes (every model's) and removing it (through the engine when one runs). */
export interface StoredKvActions {
  usage(): Promise<StoredKvUsage | null>;
  clear(): Promise<void>;
}

function StoredKvSection({ actions }: { actions: StoredKvActions }) {
  const [usage, setUsage] = useState<StoredKvUsage | null | 'reading'>('reading');
  const [error, setError] = useState<string | null>(null);
  const [clearing, setClearing] = useState(false);
  const read = useCallback(async () => {
    try {
      setUsage(await actions.usage());
    } catch (e) {
      setError(`The stored KV could not be read: ${errorMessage(e)}`);
    }
  }, [actions]);
  useEffect(() => {
    void read();
  }, [read]);
  const clear = async () => {
    setClearing(true);
    setError(null);
    try {
      await actions.clear();
    } catch (e) {
      setError(`The stored KV could not be cleared: ${errorMessage(e)}`);
    }
    await read();
    setClearing(false);
  };
  return (
    <section data-testid="stored-kv">
      <h3>Conversations' KV</h3>
      <p className="muted small" data-testid="stored-kv-usage">
        {usage === 'reading'
          ? 'Reading…'
          : usage === null
            ? 'This browser gives the page no private file system, so each conversation reads its history again after a reload.'
            : `${usage.records} conversation${usage.records === 1 ? '' : 's'}, ${formatBytes(usage.bytes)}, kept in ${usage.where} so that they resume after a reload without reading their history again.`}
      </p>
      {usage !== null && (
        <button
          type="button"
          className="danger"
          onClick={() => void clear()}
          disabled={clearing || usage === 'reading' || usage.records === 0}
          data-testid="clear-stored-kv"
        >
          Clear stored KV
        </button>
      )}
      {error && (
        <div className="alert" role="alert" data-testid="stored-kv-error">
          {error}
        </div>
      )}
    </section>
  );
}

export function ModelsPanel({
  api,
  selectedId,
  fit,
  storedKv,
  onSelect,
  onClose,
}: {
  api: ModelsApi;
  selectedId: string | null;
  fit: FitContext;
  storedKv: StoredKvActions;
  onSelect: (id: string) => void;
  onClose: () => void;
}) {
  const [url, setUrl] = useState('');
  const storedIds = new Set(api.models.map((m) => m.id));
  const completeIds = new Set(api.models.filter((m) => m.complete).map((m) => m.id));
  const select = (model: StoredModel | null) => {
    if (model?.complete) onSelect(model.id);
  };
  return (
    <Modal titleId="models-title" testId="models-panel" onClose={onClose}>
      <header className="modal-header">
        <h2 id="models-title">Models</h2>
        <button type="button" className="icon" onClick={onClose} aria-label="Close">
          ✕
        </button>
      </header>
      {api.error && (
        <div className="alert" role="alert" data-testid="models-error">
          {api.error}
        </div>
      )}
      <section>
        <h3>Stored on this device</h3>
        {api.quota && (
          <div className="quota" data-testid="storage-quota">
            <div className="bar">
              <div
                className="bar-fill bar-scratch"
                style={{
                  width: `${api.quota.quota ? Math.min(100, (api.quota.usage / api.quota.quota) * 100) : 0}%`,
                }}
              />
            </div>
            <span className="muted small">
              {formatBytes(api.quota.usage)} used of {formatBytes(api.quota.quota)} available to this site
            </span>
          </div>
        )}
        {api.models.length === 0 ? (
          <p className="muted">No models stored yet. Download one below or open a .gguf file.</p>
        ) : (
          <ul className="stored-list">
            {api.models.map((model) => (
              <StoredRow
                key={model.id}
                model={model}
                api={api}
                selected={model.id === selectedId}
                onSelect={onSelect}
                fit={fit}
              />
            ))}
          </ul>
        )}
      </section>
      <StoredKvSection actions={storedKv} />
      <section>
        <h3>Open a file</h3>
        <label className="file-button">
          <input
            type="file"
            accept=".gguf"
            data-testid="model-file-input"
            onChange={async (event) => {
              const file = event.target.files?.[0];
              event.target.value = '';
              if (file) select(await api.importFile(file));
            }}
          />
          <span className="button-like">Choose a .gguf file…</span>
        </label>
        <span className="muted small"> A copy is stored so it also works offline.</span>
      </section>
      <section>
        <h3>Download</h3>
        <ul className="preset-list">
          {api.demoAvailable && (
            <li className="preset" data-testid="preset-demo">
              <div>
                <div className="stored-name">{DEMO_MODEL_NAME}</div>
                <div className="muted small">Trained by the project, shipped with this app; the page starts on it</div>
              </div>
              <button
                type="button"
                disabled={storedIds.has(DEMO_MODEL_ID)}
                onClick={async () => select(await api.downloadDemo())}
              >
                {storedIds.has(DEMO_MODEL_ID) ? (completeIds.has(DEMO_MODEL_ID) ? 'Stored' : 'In list') : 'Get'}
              </button>
            </li>
          )}
          {api.demoAvailable === false && (
            <li className="preset muted small" data-testid="preset-demo-missing">
              The demo model is not available here (not part of this build, or offline).
            </li>
          )}
          {MODEL_PRESETS.map((preset) => (
            <PresetRow
              key={preset.id}
              preset={preset}
              fit={fit}
              stored={storedIds.has(preset.id) ? (completeIds.has(preset.id) ? 'complete' : 'incomplete') : null}
              onDownload={async () => select(await api.downloadPreset(preset))}
            />
          ))}
        </ul>
        <form
          className="url-form"
          onSubmit={async (event) => {
            event.preventDefault();
            if (url.trim()) select(await api.downloadUrl(url.trim()));
          }}
        >
          <input
            type="url"
            placeholder="https://…/model.gguf"
            value={url}
            onChange={(e) => setUrl(e.target.value)}
            aria-label="GGUF URL"
            data-testid="model-url"
          />
          <button type="submit">Download URL</button>
        </form>
      </section>
    </Modal>
  );
}
