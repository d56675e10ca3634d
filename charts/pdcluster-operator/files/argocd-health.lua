-- Argo CD health of a PDCluster (argocd-cm: resource.customizations.health.pdcluster.io_PDCluster).
-- Tested in tests/unit/test_argocd_health.py against the statuses the operator writes.
local hs = {status = "Progressing", message = "waiting for the operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
if obj.status.observedGeneration ~= obj.metadata.generation then
  hs.message = "the operator has not seen the latest spec yet"
  return hs
end
local c = {}
for _, condition in ipairs(obj.status.conditions) do
  c[condition.type] = condition
end
if c.Degraded ~= nil and c.Degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = c.Degraded.reason .. ": " .. c.Degraded.message
elseif c.Stalled ~= nil and c.Stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = c.Stalled.reason .. ": " .. c.Stalled.message
elseif c.Ready ~= nil and c.Ready.reason == "Suspended" then
  hs.status = "Suspended"
  hs.message = c.Ready.message
elseif c.Progressing ~= nil and c.Progressing.reason == "Paused" then
  hs.status = "Suspended"
  hs.message = c.Progressing.message
elseif c.Ready ~= nil and c.Ready.status == "True" and (c.Progressing == nil or c.Progressing.status ~= "True") then
  hs.status = "Healthy"
  hs.message = c.Ready.message
elseif c.Progressing ~= nil and c.Progressing.status == "True" then
  hs.message = c.Progressing.message
elseif c.Ready ~= nil then
  hs.message = c.Ready.message
end
return hs
