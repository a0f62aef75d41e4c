import { readdirSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import react from '@vitejs/plugin-react';
import { defineConfig, type Plugin } from 'vite';
import { VitePWA } from 'vite-plugin-pwa';

const root = dirname(fileURLToPath(import.meta.url));

/** Browser test pages (`e2e/harness/*.html`): served by `vite` in dev, and built only in `--mode e2e`. */
function harnessPages(): Record<string, string> {
  const dir = resolve(root, 'e2e/harness');
  const pages: Record<string, string> = {};
  for (const file of readdirSync(dir)) {
    if (file.endsWith('.html')) pages[`harness-${file.slice(0, -'.html'.length)}`] = resolve(dir, file);
  }
  return pages;
}

/**
 * The chat page's Content-Security-Policy: no 'unsafe-eval' and no inline scripts (chat templates run in an
 * interpreter, never as code; e2e/security.spec.ts runs a model under it). Downloads may come from any http(s) hub
 * mirror the user sets. Built pages only: the dev server's React refresh preamble is an inline script.
 */
export const CONTENT_SECURITY_POLICY = [
  "default-src 'self'",
  "script-src 'self'",
  "worker-src 'self'",
  "style-src 'self' 'unsafe-inline'",
  "img-src 'self' data: blob:",
  "connect-src 'self' https: http://localhost:* http://127.0.0.1:*",
  "object-src 'none'",
  "base-uri 'self'",
  "form-action 'self'",
  "manifest-src 'self'",
].join('; ');

function contentSecurityPolicy(): Plugin {
  return {
    name: 'longtab-content-security-policy',
    apply: 'build',
    transformIndexHtml: {
      order: 'post',
      handler: (_html, context) =>
        context.path === '/index.html'
          ? [
              {
                tag: 'meta',
                attrs: { 'http-equiv': 'Content-Security-Policy', content: CONTENT_SECURITY_POLICY },
                injectTo: 'head-prepend',
              },
            ]
          : [],
    },
  };
}

export default defineConfig(({ mode }) => {
  const e2e = mode === 'e2e';
  return {
    plugins: [
      react(),
      contentSecurityPolicy(),
      // The chat page's service worker precaches the app shell (HTML, JS incl. the engine worker, CSS, icons) so it
      // works offline after one visit. Model files are stored by the app in OPFS (app/storage/models.ts), never here.
      VitePWA({
        registerType: 'autoUpdate',
        // Registered by app/main.tsx, so the e2e harness pages never install it.
        injectRegister: false,
        manifest: {
          name: 'longtab: a local LLM in a browser tab',
          short_name: 'longtab',
          description: 'Chat with language models on your own GPU through WebGPU. Nothing leaves the tab.',
          theme_color: '#4f46e5',
          background_color: '#f7f7f8',
          display: 'standalone',
          start_url: '/',
          scope: '/',
          icons: [
            { src: '/icons/icon-192.png', sizes: '192x192', type: 'image/png' },
            { src: '/icons/icon-512.png', sizes: '512x512', type: 'image/png' },
            { src: '/icons/maskable-512.png', sizes: '512x512', type: 'image/png', purpose: 'maskable' },
            { src: '/favicon.svg', sizes: 'any', type: 'image/svg+xml' },
          ],
        },
        workbox: {
          globPatterns: ['**/*.{js,css,html,svg,png,webmanifest,wasm}'],
          globIgnores: ['**/models/**', '**/*.gguf'],
          maximumFileSizeToCacheInBytes: 16 * 1024 * 1024,
          navigateFallback: '/index.html',
          // Test harness pages and model files are never answered with the app shell.
          navigateFallbackDenylist: [/^\/e2e\//, /^\/models\//, /\.gguf$/],
          clientsClaim: true,
          skipWaiting: true,
          cleanupOutdatedCaches: true,
        },
      }),
    ],
    // Module workers with code splitting (the engine worker, the kernel test worker).
    worker: { format: 'es' },
    build: {
      // The e2e build keeps its own folder so it never ships in, or overwrites, the app's dist/.
      outDir: e2e ? 'dist/e2e' : 'dist',
      target: 'es2022',
      rollupOptions: {
        input: { main: resolve(root, 'index.html'), ...(e2e ? harnessPages() : {}) },
      },
    },
  };
});
