import { expect, type Page, type TestInfo, test } from '@playwright/test';

async function attachScreenshot(page: Page, testInfo: TestInfo, name: string): Promise<void> {
  const path = testInfo.outputPath(`${name}.png`);
  await page.screenshot({ path, fullPage: true });
  await testInfo.attach(name, { path, contentType: 'image/png' });
}

function collectPageErrors(page: Page): string[] {
  const errors: string[] = [];
  page.on('pageerror', (error) => errors.push(error.message));
  return errors;
}

test('the app page loads and reports that WebGPU is available', async ({ page }, testInfo) => {
  const errors = collectPageErrors(page);
  await page.goto('/');
  await expect(page).toHaveTitle('longtab');
  await expect(page.getByRole('heading', { level: 1 })).toHaveText('longtab');
  await expect(page.getByText('The chat page is coming')).toBeVisible();
  const status = page.getByTestId('webgpu-status');
  await expect(status).toHaveAttribute('data-state', 'available');
  await expect(status).toContainText('WebGPU is available');
  await attachScreenshot(page, testInfo, 'app-webgpu-available');
  expect(errors).toEqual([]);
});

test('without WebGPU the app page says which browsers it needs', async ({ page }, testInfo) => {
  const errors = collectPageErrors(page);
  // A browser without WebGPU has no navigator.gpu at all.
  await page.addInitScript(() => {
    Object.defineProperty(Navigator.prototype, 'gpu', { value: undefined, configurable: true });
  });
  await page.goto('/');
  const status = page.getByTestId('webgpu-status');
  await expect(status).toHaveAttribute('data-state', 'unavailable');
  await expect(status).toContainText('WebGPU is not available');
  await expect(status).toContainText('Chrome or Edge 113');
  await expect(status).toContainText('Safari 26');
  await expect(status).toContainText('Firefox 141');
  await attachScreenshot(page, testInfo, 'app-webgpu-unavailable');
  expect(errors).toEqual([]);
});
