-- Argo CD health check for kvfleet.io/InferenceService (kstatus-style conditions).
--
-- Install it in argocd-cm (see docs/gitops.md):
--   resource.customizations.health.kvfleet.io_InferenceService: |
--     <this file>
--
-- Healthy      Ready=True, and the operator has observed the current generation
--              (status.observedGeneration == metadata.generation).
-- Degraded     Degraded=True for the current generation (invalid spec, missing Secret,
--              stalled rollout), with the condition's reason and message.
-- Progressing  anything else: no status yet, a spec change the operator has not observed,
--              a rollout under way, Ready=False without Degraded.
-- Argo CD runs this with gopher-lua (Lua 5.1): plain tables, no libraries needed.

local hs = {}

local function condition(conditions, type)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == type then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.reason or fallback
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local status = obj.status
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to report status"
  return hs
end

local observed = status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe generation " .. tostring(generation)
  if observed ~= nil then
    hs.message = hs.message .. " (last observed: " .. tostring(observed) .. ")"
  end
  return hs
end

-- A condition set for an older generation says nothing about the current spec.
local function current(c)
  if c == nil then
    return nil
  end
  if generation ~= nil and c.observedGeneration ~= nil and c.observedGeneration < generation then
    return nil
  end
  return c
end

local ready = current(condition(status.conditions, "Ready"))
local progressing = current(condition(status.conditions, "Progressing"))
local degraded = current(condition(status.conditions, "Degraded"))

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "Degraded")
  return hs
end

if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready, "Ready")
  return hs
end

hs.status = "Progressing"
if progressing ~= nil and progressing.status == "True" then
  hs.message = describe(progressing, "Progressing")
else
  hs.message = describe(ready, "Waiting for Ready")
end
return hs
