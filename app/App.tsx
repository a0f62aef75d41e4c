/**
 * The chat page: conversations (IndexedDB), the engine (a worker, through engine/engine-client.ts), models (OPFS),
 * live stats. Every change to a conversation is saved as it happens, so a reload, a crash or a lost GPU device
 * never loses one; its KV is kept too (the engine's KV store, OPFS), so after a reload it answers without reading its
 * history again.
 */
import { useCallback, useEffect, useMemo, useRef, useState } from 'react';
import { softwareAdapterNote } from './components/adapter-note.ts';
import { ChatView } from './components/ChatView.tsx';
import { DemoModelNotice } from './components/DemoModelNotice.tsx';
import { kvHoldsText } from './components/kv-summary.ts';
import { Modal } from './components/Modal.tsx';
import { type FitContext, ModelsPanel } from './components/ModelsPanel.tsx';
import { checkWebGpu, NoWebGpu, type WebGpuCheck } from './components/NoWebGpu.tsx';
import { SettingsPanel } from './components/SettingsPanel.tsx';
import { Sidebar } from './components/Sidebar.tsx';
import { EMPTY_PERF, type Perf, StatsPanel } from './components/StatsPanel.tsx';
import { saveTextFile } from './components/save-file.ts';
import { errorCode, errorMessage, pageDebug } from './engine/engine-client.ts';
import { type SamplingFields, samplingFields } from './engine/sampling-request.ts';
import type { ChatMessageParam, LoadProgress } from './engine/types.ts';
import { type EngineStatus, type LoadRequest, useEngine } from './engine/use-engine.ts';
import { CHAT_PRESET, DEMO_MODEL_ID, DEMO_MODEL_NAME } from './models/presets.ts';
import { useDefaultModel } from './models/use-default-model.ts';
import {
  conversationMarkdown,
  conversationsFileText,
  fileNameFrom,
  parseConversationsFile,
  withUnusedIds,
} from './storage/conversation-file.ts';
import {
  type Conversation,
  type ConversationMode,
  deleteAllConversations,
  deleteConversation,
  loadConversations,
  newConversation,
  newId,
  passageText,
  type StoredMessage,
  saveConversation,
  titleFrom,
  withEditedMessage,
} from './storage/conversations.ts';
import { formatBytes, openModelFile } from './storage/models.ts';
import { DEFAULT_SETTINGS, loadSettings, type Settings, saveSettings } from './storage/settings.ts';
import { useModels } from './storage/use-models.ts';
import { applyTheme } from './theme.ts';

const SAVE_EVERY_MS = 400;
const SAMPLE_EVERY_MS = 500;
const MAX_SAMPLES = 120;

/** What a debug page (`?debug=1`) exposes to the e2e tests as `window.longtabDebug`. */
interface LongtabDebug {
  /** Destroys the engine worker's GPU device (as a driver reset would). */
  destroyDevice(): Promise<void>;
  /** The messages of the last chat request the page sent (what the model saw); null after a text-mode request. */
  lastRequest: ChatMessageParam[] | null;
  /** The prompt of the last text-mode (completions) request; null after a chat request. */
  lastPrompt: string | null;
  /** The sampling fields of that request. */
  lastSampling: SamplingFields | null;
}

function debugHooks(): LongtabDebug | undefined {
  return (window as { longtabDebug?: LongtabDebug }).longtabDebug;
}

function progressText(progress: LoadProgress | null): string {
  if (!progress) return 'Starting…';
  const share = progress.bytesTotal ? ` ${Math.round((progress.bytesDone / progress.bytesTotal) * 100)}%` : '';
  return `${progress.phase}${share}`;
}

/** A chat-mode conversation as the messages the model's chat template gets (failed and empty replies left out). */
function chatHistory(conversation: Conversation): ChatMessageParam[] {
  const history: ChatMessageParam[] = [];
  if (conversation.systemPrompt.trim()) history.push({ role: 'system', content: conversation.systemPrompt });
  for (const m of conversation.messages) {
    if (m.role === 'assistant' && (m.status === 'error' || !m.content)) continue;
    history.push({ role: m.role, content: m.content });
  }
  return history;
}

export function App() {
  const [gpu, setGpu] = useState<WebGpuCheck>({ state: 'checking' });
  useEffect(() => {
    void checkWebGpu().then(setGpu);
  }, []);
  if (gpu.state === 'checking') return <div className="splash">Checking for WebGPU…</div>;
  if (gpu.state === 'unavailable') return <NoWebGpu unavailable={gpu} />;
  return <ChatApp />;
}

function ChatApp() {
  const [settings, setSettings] = useState<Settings | null>(null);
  const [conversations, setConversations] = useState<Conversation[]>([]);
  const [activeId, setActiveId] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const [perf, setPerf] = useState<Perf>(EMPTY_PERF);
  const [panel, setPanel] = useState<'models' | 'settings' | 'delete-all' | null>(null);
  const [sidebarOpen, setSidebarOpen] = useState(false);
  const closeSidebar = useCallback(() => setSidebarOpen(false), []);
  // On a phone the stats start folded away (the Stats button opens them below the chat).
  const [statsOpen, setStatsOpen] = useState(() => window.matchMedia('(min-width: 901px)').matches);
  const [chatError, setChatError] = useState<string | null>(null);
  const {
    state: engineState,
    ensure,
    reportError,
    forget,
    storedKv,
    clearStoredKv,
    destroyDevice,
    lastLoadError,
    forgetFailure,
  } = useEngine();
  /**
   * Why a conversation's KV was not kept or not used (the engine's note): a stored copy refused, the storage full.
   * Shown until dismissed or replaced; the chat goes on meanwhile.
   */
  const [kvNote, setKvNote] = useState<string | null>(null);
  /** The last reply's kv_note: the same note in stats() is not news. */
  const replyKvNoteRef = useRef<string | null>(null);
  const lastStatsKvNoteRef = useRef<string | null>(null);
  const storedKvActions = useMemo(() => ({ usage: storedKv, clear: clearStoredKv }), [storedKv, clearStoredKv]);
  // After a lost device the page waits for the person (Reload model, or a new message) instead of reloading by itself.
  const deviceLost = engineState.error?.code === 'device-lost';
  const models = useModels(settings?.hubBaseUrl ?? DEFAULT_SETTINGS.hubBaseUrl);
  const streamRef = useRef<{ abort(): void } | null>(null);
  const conversationsRef = useRef(conversations);
  conversationsRef.current = conversations;

  useEffect(() => {
    void (async () => {
      const [loadedSettings, loaded] = await Promise.all([loadSettings(), loadConversations()]);
      setSettings(loadedSettings);
      // A first visit's empty conversation is stored once it changes (its first message, a system prompt), not
      // before: startup may run twice (React's strict mode in development), and each run would store its own.
      if (loaded.length === 0) loaded.push(newConversation(loadedSettings.defaultSystemPrompt));
      setConversations(loaded);
      setActiveId(loaded[0]!.id);
    })();
  }, []);

  const theme = settings?.theme;
  useEffect(() => {
    if (theme) applyTheme(theme);
  }, [theme]);

  const updateSettings = useCallback((patch: Partial<Settings>) => {
    setSettings((current) => {
      const next = { ...(current ?? DEFAULT_SETTINGS), ...patch };
      void saveSettings(next);
      return next;
    });
  }, []);

  /** Selects the default model only while nothing is chosen: a choice the user made meanwhile stays. */
  const selectDefault = useCallback((modelId: string) => {
    setSettings((current) => {
      if (!current || current.modelId !== null) return current;
      const next = { ...current, modelId };
      void saveSettings(next);
      return next;
    });
  }, []);
  const defaultModel = useDefaultModel(settings, models, selectDefault);

  /** Replaces a conversation in state and in IndexedDB. */
  const putConversation = useCallback(async (conversation: Conversation, persist = true) => {
    setConversations((list) => {
      const rest = list.filter((c) => c.id !== conversation.id);
      return [conversation, ...rest].sort((a, b) => b.updatedAt - a.updatedAt);
    });
    if (persist) await saveConversation(conversation);
  }, []);

  const active = conversations.find((c) => c.id === activeId) ?? null;
  const selectedModel = models.models.find((m) => m.id === settings?.modelId && m.complete) ?? null;

  const loadRequest = useMemo((): LoadRequest | null => {
    if (!settings || !selectedModel) return null;
    const kvBudgetBytes = Math.round(settings.kvBudgetMiB * 1024 * 1024);
    return {
      key: `${selectedModel.id}|${settings.kv}|${kvBudgetBytes}`,
      label: selectedModel.name,
      open: () => openModelFile(selectedModel.id),
      kv: settings.kv,
      kvBudgetBytes,
    };
  }, [settings, selectedModel]);

  // Load the selected model as soon as it (or the KV setup) changes, so the stats show it before the first message.
  // A load that failed is not started again by itself (a stored model list that changes meanwhile makes a new request
  // of the same key): its error stays until a message or another choice asks again.
  useEffect(() => {
    if (!loadRequest || busy || deviceLost || engineState.failedKey === loadRequest.key) return;
    const timer = setTimeout(() => void ensure(loadRequest), 300);
    return () => clearTimeout(timer);
  }, [loadRequest, busy, deviceLost, ensure, engineState.failedKey]);
  // Another request meanwhile (another model or KV setup, or none while the model is stored again) ends the hold: back
  // on the failed key, the page loads it again.
  const requestKey = loadRequest?.key ?? null;
  useEffect(() => {
    if (engineState.failedKey !== null && engineState.failedKey !== requestKey) forgetFailure();
  }, [requestKey, engineState.failedKey, forgetFailure]);

  useEffect(() => {
    if (!pageDebug()) return;
    const w = window as { longtabDebug?: LongtabDebug };
    w.longtabDebug = { destroyDevice, lastRequest: null, lastPrompt: null, lastSampling: null };
    return () => {
      delete w.longtabDebug;
    };
  }, [destroyDevice]);

  // The KV store's last problem (a save that failed on a full quota, a refused copy) is shown when it changes.
  const statsKvNote = engineState.stats?.stored?.note ?? null;
  useEffect(() => {
    const previous = lastStatsKvNoteRef.current;
    lastStatsKvNoteRef.current = statsKvNote;
    if (statsKvNote !== null && statsKvNote !== previous && statsKvNote !== replyKvNoteRef.current) {
      setKvNote(statsKvNote);
    }
  }, [statsKvNote]);

  // A model that becomes ready ends the chat's error banner: it was about the request that could not run then.
  useEffect(() => {
    if (engineState.status === 'ready' && engineState.loadedKey !== null) setChatError(null);
  }, [engineState.status, engineState.loadedKey]);

  /** The Reload model button after a lost device: a fresh engine (worker and device) loads the same model. */
  const reloadModel = useCallback(() => {
    setChatError(null);
    if (loadRequest) void ensure(loadRequest);
  }, [loadRequest, ensure]);

  /** Asks for the reply to `conversation`; `sentAt` (performance.now()) is when the person sent it: TTFT counts from there. */
  const generate = useCallback(
    async (conversation: Conversation, sentAt: number) => {
      if (!settings || !loadRequest) return;
      setChatError(null);
      setBusy(true);
      const reply: StoredMessage = {
        id: newId('m'),
        role: 'assistant',
        content: '',
        createdAt: Date.now(),
        status: 'streaming',
      };
      let working: Conversation = {
        ...conversation,
        messages: [...conversation.messages, reply],
        updatedAt: Date.now(),
      };
      await putConversation(working);
      const setReply = (patch: Partial<StoredMessage>) => {
        const messages = working.messages.slice();
        messages[messages.length - 1] = { ...messages[messages.length - 1]!, ...patch };
        working = { ...working, messages, updatedAt: Date.now() };
      };
      let lastSave = performance.now();
      let firstAt: number | null = null;
      let tokens = 0;
      let sampleAt = performance.now();
      let sampleTokens = 0;
      const series: Perf['series'] = [];
      replyKvNoteRef.current = null;
      setPerf((p) => ({ ...p, live: true, tokens: 0, series: [], ttftMs: null, tpotMs: null, prompt: null }));
      try {
        const engine = await ensure(loadRequest);
        // The note stays with the reply: it says what failed, not where to look (that message goes on recovery).
        if (!engine) throw new Error(lastLoadError() ?? 'The model is not loaded.');
        const sampling = samplingFields(settings);
        // Text mode: the conversation is one passage, continued through the completions API (no chat template).
        const prompt = conversation.mode === 'text' ? passageText(conversation.messages) : null;
        const messages = prompt === null ? chatHistory(conversation) : null;
        const hooks = debugHooks();
        if (hooks) Object.assign(hooks, { lastRequest: messages, lastPrompt: prompt, lastSampling: sampling });
        const stream =
          messages === null
            ? await engine.completions.create({ prompt: prompt ?? '', stream: true, ...sampling })
            : await engine.chat.completions.create({
                messages,
                stream: true,
                ...sampling,
                conversation_id: conversation.id,
                context_overflow: 'drop_oldest_turns',
              });
        streamRef.current = stream;
        let content = '';
        let finish: string | null = null;
        for await (const chunk of stream) {
          const choice = chunk.choices[0];
          const delta = choice && ('text' in choice ? choice.text : choice.delta.content);
          const now = performance.now();
          if (delta) {
            content += delta;
            tokens++;
            if (firstAt === null) firstAt = now;
            setReply({ content });
          }
          if (choice?.finish_reason) finish = choice.finish_reason;
          // The reply's last, shorter interval is a sample too: a reply of a few tokens still draws its curve.
          const last = choice?.finish_reason != null && tokens > sampleTokens && now > sampleAt;
          if (now - sampleAt >= SAMPLE_EVERY_MS || last) {
            series.push({ t: now, tps: ((tokens - sampleTokens) * 1000) / (now - sampleAt) });
            if (series.length > MAX_SAMPLES) series.shift();
            sampleAt = now;
            sampleTokens = tokens;
          }
          const live = chunk.usage?.longtab;
          // TTFT is the person's wait: from the send to the first token on the page, loading and queueing included
          // (the engine's ttft_ms starts at its prefill).
          const ttftMs = firstAt === null ? null : firstAt - sentAt;
          setPerf((p) => ({
            ...p,
            live: true,
            tokens,
            series: series.slice(),
            ttftMs,
            decodeTps:
              live?.decode_tokens_per_second ??
              (firstAt !== null && tokens > 1 && now > firstAt ? ((tokens - 1) * 1000) / (now - firstAt) : p.decodeTps),
            tpotMs: live?.tpot_ms ?? (firstAt !== null && tokens > 1 ? (now - firstAt) / (tokens - 1) : p.tpotMs),
            prefillTps: live?.prefill_tokens_per_second ?? p.prefillTps,
          }));
          const usage = chunk.usage;
          if (usage) {
            const prompt = {
              tokens: usage.prompt_tokens,
              cached: usage.prompt_tokens_details.cached_tokens,
              from: usage.longtab.kv_from,
            };
            setPerf((p) => ({ ...p, prompt }));
            // The conversation's stored KV was refused (damaged, another model): its history was read again.
            if (usage.longtab.kv_note) {
              replyKvNoteRef.current = usage.longtab.kv_note;
              setKvNote(usage.longtab.kv_note);
            }
            setReply({
              stats: {
                completionTokens: usage.completion_tokens,
                decodeTokensPerSecond: live?.decode_tokens_per_second ?? 0,
                ttftMs: ttftMs ?? 0,
              },
            });
          }
          await putConversation(working, now - lastSave > SAVE_EVERY_MS);
          if (now - lastSave > SAVE_EVERY_MS) lastSave = now;
        }
        setReply({
          status: finish === 'abort' ? 'stopped' : 'done',
          note: finish === 'length' ? 'reached max tokens' : undefined,
        });
      } catch (error) {
        if (errorCode(error) === 'device-lost') {
          // The partial reply stays, marked interrupted (the next request sends it as the model's turn); the banner
          // above the chat says what happened and offers the reload.
          setReply({ status: 'interrupted', note: 'The GPU device was lost; the reply stops here.' });
        } else {
          setReply({ status: 'error', note: errorMessage(error) });
          setChatError(errorMessage(error));
        }
        await reportError(error);
      } finally {
        streamRef.current = null;
        await putConversation(working);
        setPerf((p) => ({ ...p, live: false }));
        setBusy(false);
      }
    },
    [settings, loadRequest, ensure, putConversation, reportError, lastLoadError],
  );

  const send = useCallback(
    async (text: string) => {
      const sentAt = performance.now();
      if (!active) return;
      const message: StoredMessage = {
        id: newId('m'),
        role: 'user',
        content: text,
        createdAt: Date.now(),
        status: 'done',
      };
      const next: Conversation = {
        ...active,
        title: active.messages.length === 0 && active.title === 'New chat' ? titleFrom(text) : active.title,
        messages: [...active.messages, message],
        updatedAt: Date.now(),
      };
      await putConversation(next);
      await generate(next, sentAt);
    },
    [active, generate, putConversation],
  );

  const regenerate = useCallback(async () => {
    const sentAt = performance.now();
    if (!active || busy) return;
    const messages = active.messages.slice();
    while (messages.length && messages[messages.length - 1]!.role === 'assistant') messages.pop();
    if (!messages.length) return;
    await generate({ ...active, messages }, sentAt);
  }, [active, busy, generate]);

  const editAndResend = useCallback(
    async (messageId: string, text: string) => {
      const sentAt = performance.now();
      if (!active || busy) return;
      const next = withEditedMessage(active, messageId, text);
      if (!next) return;
      await putConversation(next);
      await generate(next, sentAt);
    },
    [active, busy, generate, putConversation],
  );

  const stop = useCallback(() => streamRef.current?.abort(), []);

  const newChat = useCallback(
    async (mode: ConversationMode = 'chat') => {
      const conversation = newConversation(settings?.defaultSystemPrompt ?? DEFAULT_SETTINGS.defaultSystemPrompt, mode);
      await putConversation(conversation);
      setActiveId(conversation.id);
      setSidebarOpen(false);
    },
    [settings, putConversation],
  );

  const removeConversation = useCallback(
    async (id: string) => {
      await deleteConversation(id);
      await forget(id);
      const rest = conversationsRef.current.filter((c) => c.id !== id);
      setConversations(rest);
      if (activeId === id) setActiveId(rest[0]?.id ?? null);
      if (rest.length === 0) await newChat();
    },
    [activeId, newChat, forget],
  );

  /** The open conversation in `mode`; the next reply reads its messages that way. */
  const setMode = useCallback(
    (mode: ConversationMode) => {
      if (active && !busy) void putConversation({ ...active, mode });
    },
    [active, busy, putConversation],
  );

  /** The demo notice's text mode: the open conversation while it is empty, else a new one. */
  const startTextMode = useCallback(() => {
    if (active && active.messages.length === 0) setMode('text');
    else if (!busy) void newChat('text');
  }, [active, busy, setMode, newChat]);

  /** The demo notice's chat model, in one step: stored (or resumed, or downloaded) and then chosen. */
  const getChatModel = useCallback(async () => {
    const stored = models.models.find((m) => m.id === CHAT_PRESET.id);
    const done = stored?.complete
      ? stored
      : stored
        ? await models.resume(stored.id)
        : await models.downloadPreset(CHAT_PRESET);
    if (done?.complete) updateSettings({ modelId: done.id });
  }, [models, updateSettings]);

  const exportAll = useCallback(() => {
    const day = new Date().toISOString().slice(0, 10);
    saveTextFile(
      `longtab-conversations-${day}.json`,
      conversationsFileText(conversationsRef.current),
      'application/json',
    );
  }, []);

  const exportActive = useCallback(() => {
    if (active) saveTextFile(fileNameFrom(active.title, 'md'), conversationMarkdown(active), 'text/markdown');
  }, [active]);

  /** Adds a file's conversations beside the stored ones; a taken id gets a new one, so nothing is overwritten. */
  const importConversations = useCallback(async (file: File): Promise<string> => {
    const imported = parseConversationsFile(await file.text());
    const fresh = withUnusedIds(
      imported,
      conversationsRef.current.map((c) => c.id),
      () => newId('c'),
    );
    for (const conversation of fresh) await saveConversation(conversation);
    setConversations((list) => [...list, ...fresh].sort((a, b) => b.updatedAt - a.updatedAt));
    const renamed = fresh.filter((c, i) => c.id !== imported[i]!.id).length;
    const plural = (n: number) => (n === 1 ? '' : 's');
    if (fresh.length === 0) return `${file.name} holds no conversations; nothing was added.`;
    return (
      `Imported ${fresh.length} conversation${plural(fresh.length)} from ${file.name}` +
      (renamed ? ` (${renamed} got a new id: one with the same id was already here).` : '.')
    );
  }, []);

  const deleteAll = useCallback(async () => {
    const ids = conversationsRef.current.map((c) => c.id);
    await deleteAllConversations();
    await Promise.all(ids.map((id) => forget(id)));
    // Stored KV of conversations no longer listed (deleted by another tab, a failed removal) goes too.
    await clearStoredKv().catch(() => {});
    setConversations([]);
    setPanel(null);
    await newChat();
  }, [forget, clearStoredKv, newChat]);

  if (!settings) return <div className="splash">Opening your conversations…</div>;

  // What the page shows about the model: the engine's state, except that a chosen model not loaded yet reads as
  // loading (also in the moment before its load starts, never as the previous model ready), and so does the default
  // model while it is being stored.
  const fetchingDefault = defaultModel === 'fetching' && settings.modelId === null;
  const pending =
    loadRequest !== null &&
    engineState.loadedKey !== loadRequest.key &&
    (engineState.status === 'ready' || engineState.status === 'idle');
  const status: EngineStatus = deviceLost ? 'error' : fetchingDefault || pending ? 'loading' : engineState.status;
  const demoDownload = models.downloads[DEMO_MODEL_ID];
  const chatDownload = models.downloads[CHAT_PRESET.id];
  const softwareNote = softwareAdapterNote(engineState.stats?.adapter ?? null);
  const adapter = engineState.stats?.adapter ?? null;
  const fitContext: FitContext = {
    kvBudgetBytes: Math.round(settings.kvBudgetMiB * 1024 * 1024),
    gpu: adapter && {
      maxBufferSize: adapter.maxBufferSize,
      maxStorageBufferBindingSize: adapter.maxStorageBufferBindingSize,
      peakBytes: engineState.stats?.memory.peak ?? 0,
    },
    runningModelId:
      status === 'ready' && loadRequest !== null && engineState.loadedKey === loadRequest.key
        ? (selectedModel?.id ?? null)
        : null,
  };
  const loadProgress: LoadProgress | null = fetchingDefault
    ? demoDownload
      ? { phase: 'download', bytesDone: demoDownload.bytesDone, bytesTotal: demoDownload.bytesTotal ?? 0 }
      : null
    : engineState.loadingKey === loadRequest?.key
      ? engineState.progress
      : null;
  // While loading, the chip's name may shorten to an ellipsis on a narrow bar; its progress never does.
  const modelLabel =
    status === 'loading'
      ? `${fetchingDefault ? `Getting ${DEMO_MODEL_NAME}` : `Loading ${selectedModel?.name ?? 'model'}`}:`
      : status === 'ready' && engineState.model
        ? `${engineState.loadedLabel ?? engineState.model.name} · ${engineState.model.kv} KV`
        : selectedModel
          ? selectedModel.name
          : 'No model selected';

  return (
    <div className={`layout ${statsOpen ? 'with-stats' : ''}`}>
      <Sidebar
        conversations={conversations}
        activeId={activeId}
        open={sidebarOpen}
        onClose={closeSidebar}
        onNew={() => void newChat()}
        onSelect={(id) => {
          setActiveId(id);
          setSidebarOpen(false);
        }}
        onRename={(id, title) => {
          const conversation = conversations.find((c) => c.id === id);
          if (conversation) void putConversation({ ...conversation, title });
        }}
        onDelete={(id) => void removeConversation(id)}
      />
      <div className="main">
        <header className="topbar">
          <button
            type="button"
            className="icon only-narrow"
            aria-label="Conversations"
            onClick={() => setSidebarOpen((v) => !v)}
          >
            ☰
          </button>
          <h1 className="title" data-testid="conversation-title">
            {active?.title ?? 'longtab'}
          </h1>
          <button
            type="button"
            className={`model-chip ${status}`}
            onClick={() => setPanel('models')}
            data-testid="model-chip"
            data-status={status}
          >
            <span className="dot" />
            <span className="chip-name">{modelLabel}</span>{' '}
            {status === 'loading' && (
              <span className="chip-progress" data-testid="chip-progress">
                {progressText(loadProgress)}
              </span>
            )}
          </button>
          <button type="button" className="ghost" onClick={() => setPanel('settings')} data-testid="open-settings">
            Settings
          </button>
          <button type="button" className="ghost" onClick={() => setStatsOpen((v) => !v)} aria-pressed={statsOpen}>
            Stats
          </button>
        </header>
        {status === 'loading' && (
          <div className="load-bar" data-testid="load-progress">
            <div
              className="bar-fill bar-weights"
              style={{
                width: `${loadProgress?.bytesTotal ? (loadProgress.bytesDone / loadProgress.bytesTotal) * 100 : 5}%`,
              }}
            />
          </div>
        )}
        {deviceLost ? (
          <div className="alert device-lost" role="alert" data-testid="device-lost">
            <div>
              <strong>The GPU device was lost.</strong> Your conversation is saved: Reload model starts a new engine
              with the same model (sending a message does too).{' '}
              <span className="small" data-testid="device-lost-message">
                DeviceLostError: {engineState.error?.message}
              </span>
            </div>
            <button
              type="button"
              className="primary"
              onClick={reloadModel}
              disabled={!loadRequest || busy}
              data-testid="reload-model"
            >
              Reload model
            </button>
          </div>
        ) : (
          (engineState.error || chatError) && (
            <div className="alert" role="alert" data-testid="engine-error">
              {engineState.error?.message ?? chatError}
            </div>
          )
        )}
        {!selectedModel && fetchingDefault && (
          <div className="notice" data-testid="default-model">
            <span>
              Getting the demo model that ships with this page. It is stored on this device, so the page also works
              offline; other models are in Models.
            </span>
          </div>
        )}
        {!selectedModel && !fetchingDefault && (
          <div className="notice" data-testid="no-model">
            <span>
              Choose a model to start: download a preset, paste a URL, or open a .gguf file.
              {defaultModel === 'failed' && models.error ? ` The demo model could not be stored: ${models.error}` : ''}
            </span>
            <button type="button" className="primary" onClick={() => setPanel('models')} data-testid="open-models">
              Models
            </button>
            {models.quota && <span className="muted small">Storage: {formatBytes(models.quota.usage)} used</span>}
          </div>
        )}
        {softwareNote && (
          <div className="notice" data-testid="software-adapter">
            <span>{softwareNote}</span>
          </div>
        )}
        {selectedModel?.id === DEMO_MODEL_ID && (
          <DemoModelNotice
            textMode={active?.mode === 'text'}
            chatModel={{
              preset: CHAT_PRESET,
              state: chatDownload
                ? 'downloading'
                : models.models.some((m) => m.id === CHAT_PRESET.id && m.complete)
                  ? 'stored'
                  : 'absent',
              percent: chatDownload?.bytesTotal
                ? Math.floor((chatDownload.bytesDone / chatDownload.bytesTotal) * 100)
                : null,
            }}
            onTextMode={startTextMode}
            onChatModel={() => void getChatModel()}
          />
        )}
        {kvNote && (
          <div className="notice" role="status" data-testid="kv-note">
            <span>{kvNote}</span>
            <button type="button" onClick={() => setKvNote(null)} data-testid="kv-note-dismiss">
              Dismiss
            </button>
          </div>
        )}
        <ChatView
          conversation={active}
          busy={busy}
          canSend={Boolean(selectedModel) && status !== 'loading'}
          modelHint={selectedModel ? `Model: ${selectedModel.name}. Nothing leaves this tab.` : null}
          waitingFor={
            status === 'loading'
              ? `${fetchingDefault ? 'The demo model' : 'The model'} is loading; you can type meanwhile`
              : 'Choose a model first'
          }
          onSend={(text) => void send(text)}
          onStop={stop}
          onRegenerate={() => void regenerate()}
          onEditResend={(messageId, text) => void editAndResend(messageId, text)}
          onSystemPrompt={(systemPrompt) => active && void putConversation({ ...active, systemPrompt })}
          onMode={setMode}
        />
      </div>
      {statsOpen && <StatsPanel stats={engineState.stats} perf={perf} model={engineState.model} />}
      {panel === 'models' && (
        <ModelsPanel
          api={models}
          selectedId={settings.modelId}
          fit={fitContext}
          storedKv={storedKvActions}
          onSelect={(modelId) => {
            updateSettings({ modelId });
            setPanel(null);
          }}
          onClose={() => setPanel(null)}
        />
      )}
      {panel === 'settings' && (
        <SettingsPanel
          settings={settings}
          models={models.models}
          kvHolds={kvHoldsText(engineState.stats)}
          data={{
            count: conversations.length,
            activeTitle: active?.title ?? null,
            busy,
            exportAll,
            exportActive,
            importFile: importConversations,
            askDeleteAll: () => setPanel('delete-all'),
          }}
          onChange={updateSettings}
          onClose={() => setPanel(null)}
        />
      )}
      {panel === 'delete-all' && (
        <Modal titleId="delete-all-title" testId="delete-all-dialog" narrow onClose={() => setPanel(null)}>
          <header className="modal-header">
            <h2 id="delete-all-title">Delete all conversations?</h2>
          </header>
          <p>
            {conversations.length === 1 ? 'The conversation' : `All ${conversations.length} conversations`} and their
            messages are removed from this device. Export them first (Settings) to keep a copy.
          </p>
          <div className="confirm-actions">
            <button type="button" onClick={() => setPanel(null)} data-testid="delete-all-cancel">
              Cancel
            </button>
            <button
              type="button"
              className="danger"
              disabled={busy}
              onClick={() => void deleteAll()}
              data-testid="delete-all-confirm"
            >
              Delete all
            </button>
          </div>
        </Modal>
      )}
    </div>
  );
}
