/** Generation and engine settings. KV mode and budget take effect when the model (re)loads. */
import type { StoredModel } from '../storage/models.ts';
import type { Settings } from '../storage/settings.ts';
import { Modal } from './Modal.tsx';

export function SettingsPanel({
  settings,
  models,
  onChange,
  onClose,
}: {
  settings: Settings;
  models: StoredModel[];
  onChange: (patch: Partial<Settings>) => void;
  onClose: () => void;
}) {
  const numberField = (
    key: 'temperature' | 'topP' | 'maxTokens' | 'kvBudgetMiB',
    label: string,
    min: number,
    max: number,
    step: number,
  ) => (
    <label className="field">
      <span>{label}</span>
      <input
        type="number"
        min={min}
        max={max}
        step={step}
        value={settings[key]}
        data-testid={`setting-${key}`}
        onChange={(e) => {
          const value = Number(e.target.value);
          if (Number.isFinite(value)) onChange({ [key]: Math.min(max, Math.max(min, value)) });
        }}
      />
    </label>
  );
  return (
    <Modal titleId="settings-title" testId="settings-panel" narrow onClose={onClose}>
      <header className="modal-header">
        <h2 id="settings-title">Settings</h2>
        <button type="button" className="icon" onClick={onClose} aria-label="Close">
          ✕
        </button>
      </header>
      <section>
        <h3>Model</h3>
        <label className="field">
          <span>Stored model (manage them from the model button)</span>
          <select
            value={settings.modelId ?? ''}
            data-testid="setting-model"
            onChange={(e) => onChange({ modelId: e.target.value || null })}
          >
            <option value="">None</option>
            {models
              .filter((m) => m.complete)
              .map((m) => (
                <option key={m.id} value={m.id}>
                  {m.name}
                </option>
              ))}
          </select>
        </label>
      </section>
      <section>
        <h3>KV cache</h3>
        <div className="segmented" role="radiogroup" aria-label="KV mode">
          {(['int2', 'f16'] as const).map((mode) => (
            <label key={mode} className={settings.kv === mode ? 'on' : ''}>
              <input
                type="radio"
                name="kv"
                value={mode}
                checked={settings.kv === mode}
                data-testid={`kv-${mode}`}
                onChange={() => onChange({ kv: mode })}
              />
              {mode === 'int2' ? 'int2 (~2-bit, ~7× more context)' : 'f16 (exact)'}
            </label>
          ))}
        </div>
        {numberField('kvBudgetMiB', 'KV budget (MiB of GPU memory)', 1, 8192, 1)}
        <p className="hint">
          int2 is the default; a model whose K/V rows do not split into 2-bit groups loads f16 instead (the model chip
          and the stats show the mode in use). Changing these reloads the model before the next message.
        </p>
      </section>
      <section>
        <h3>Sampling</h3>
        {numberField('temperature', 'Temperature (0 = greedy)', 0, 2, 0.05)}
        {numberField('topP', 'Top-p', 0.01, 1, 0.01)}
        {numberField('maxTokens', 'Max new tokens', 1, 8192, 1)}
      </section>
      <section>
        <h3>New chats</h3>
        <label className="field">
          <span>Default system prompt</span>
          <textarea
            rows={3}
            value={settings.defaultSystemPrompt}
            onChange={(e) => onChange({ defaultSystemPrompt: e.target.value })}
          />
        </label>
      </section>
      <section>
        <h3>Downloads</h3>
        <label className="field">
          <span>Model hub base URL</span>
          <input
            type="url"
            value={settings.hubBaseUrl}
            data-testid="setting-hub"
            onChange={(e) => onChange({ hubBaseUrl: e.target.value })}
          />
        </label>
        <p className="hint">Presets download from &lt;base&gt;/&lt;repo&gt;/resolve/main/&lt;file&gt;.</p>
      </section>
    </Modal>
  );
}
