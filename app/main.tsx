import { StrictMode } from 'react';
import { createRoot } from 'react-dom/client';
import { App } from './App.tsx';
import { loadSettings } from './storage/settings.ts';
import { applyTheme } from './theme.ts';
import './styles.css';

// The saved theme as early as the settings answer, so the splash and the no-WebGPU page wear it too (the chat page
// applies later changes).
loadSettings()
  .then((settings) => applyTheme(settings.theme))
  // Without them the page keeps the browser's preference; the chat page's own load of the settings reports failures.
  .catch(() => {});

const container = document.getElementById('root');
if (!container) throw new Error('index.html has no #root element');
createRoot(container).render(
  <StrictMode>
    <App />
  </StrictMode>,
);

// The service worker (vite-plugin-pwa, built only by `vite build`) precaches the app shell for offline use. It takes
// over at once (skipWaiting + clientsClaim); a new version is picked up on the next load.
if (import.meta.env.PROD && 'serviceWorker' in navigator) {
  window.addEventListener('load', () => {
    navigator.serviceWorker.register('/sw.js', { scope: '/' }).catch((error: unknown) => {
      console.warn('longtab: the service worker did not register; the app will not work offline.', error);
    });
  });
}
