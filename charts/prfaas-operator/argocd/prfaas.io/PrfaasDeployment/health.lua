-- Argo CD health check for prfaas.io PrfaasDeployment (Lua 5.1, as Argo CD's gopher-lua runs it).
-- Progressing until the operator has written status for the current generation and while the
-- Ready condition is False; Degraded (with the condition's message) whenever Degraded is True;
-- Healthy when Ready is True.
local hs = {}
local status = obj.status
if status == nil or status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end
local ready, degraded
for _, condition in ipairs(status.conditions or {}) do
  if condition.type == "Ready" then
    ready = condition
  elseif condition.type == "Degraded" then
    degraded = condition
  end
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.message or degraded.reason
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message
  return hs
end
hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.message or ready.reason
else
  hs.message = "Waiting for the Ready condition"
end
return hs
