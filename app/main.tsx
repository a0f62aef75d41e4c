import { StrictMode } from 'react';
import { createRoot } from 'react-dom/client';
import { App } from './App.tsx';
import './styles.css';

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
