/**
 * The page's default model: when no model has been chosen yet (a first visit), the demo model that ships with the
 * page is stored the way the Models panel's "Get" stores it (into OPFS, so the page also answers offline after that
 * first visit) and selected, so the chat is ready with no action. A model the user picks meanwhile, or later, wins:
 * the demo is selected only while the settings still hold no choice, and the settings keep whatever was chosen.
 * A demo download that a choice overtook still completes (11 MiB), and stays stored for later.
 */
import { useEffect, useRef, useState } from 'react';
import type { Settings } from '../storage/settings.ts';
import type { ModelsApi } from '../storage/use-models.ts';
import { DEMO_MODEL_ID } from './presets.ts';

/** `fetching`: the demo is being stored; `failed`: that did not work (models.error says why); `unavailable`: no demo here. */
export type DefaultModelState = 'idle' | 'fetching' | 'failed' | 'unavailable';

/** Runs once per page load; `select(id)` must keep a choice the settings already hold (see App). */
export function useDefaultModel(
  settings: Settings | null,
  models: ModelsApi,
  select: (modelId: string) => void,
): DefaultModelState {
  const started = useRef(false);
  const [state, setState] = useState<DefaultModelState>('idle');
  const { listed, models: stored, demoAvailable, downloadDemo } = models;
  const noChoice = settings !== null && settings.modelId === null;

  useEffect(() => {
    if (started.current || !noChoice || !listed) return;
    const demo = stored.find((m) => m.id === DEMO_MODEL_ID);
    if (demo?.complete) {
      // Stored before (its selection was not saved, or the download outlived a page): no network needed.
      started.current = true;
      select(demo.id);
      return;
    }
    if (demoAvailable === null) return; // still asking the server whether this build ships it
    started.current = true;
    if (!demoAvailable) {
      setState('unavailable');
      return;
    }
    setState('fetching');
    void downloadDemo()
      .then((done) => {
        setState(done ? 'idle' : 'failed');
        if (done) select(done.id);
      })
      .catch(() => setState('failed'));
  }, [noChoice, listed, stored, demoAvailable, downloadDemo, select]);

  return state;
}
